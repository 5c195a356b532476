"""Chat prompts rendered from the checkpoint's template, through the real `openai` client, compared with
transformers' apply_chat_template on the same files (the gateway over a fake router: only the prompt matters).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from common.chat_template import ChatTemplate
from common.errors import CheckpointError
from gateway.http_api import builtin_chat_prompt, create_app
from tests.support.fakes import FakeRouter
from tests.support.fakes import core as fake_core

# Meta's Llama-3 instruct template, as its tokenizer_config.json carries it.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
THINKING = (  # a template variable set through chat_template_kwargs, as Qwen3's enable_thinking
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)
ALTERNATE = (
    "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me about <|im_end|> tokens."},
]


def with_template(
    src: Path, dst: Path, template: str | list | None, jinja: str | None = None
) -> Path:
    """A copy of `src`'s tokenizer files whose tokenizer_config.json carries `template`."""
    dst.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (dst / "chat_template.jinja").write_text(jinja)
    return dst


def hf_ids(path: Path, messages: list[dict], **kwargs) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"])


def openai_client(path: Path) -> openai.AsyncOpenAI:
    app = create_app(fake_core(path, [FakeRouter("a:1")]))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="-", http_client=http)


async def chat(path: Path, messages: list[dict], **extra) -> tuple[str, list[int]]:
    """(the template header, the prompt token ids the gateway sent to the router)."""
    async with openai_client(path) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="",
            messages=messages,
            max_tokens=1,
            extra_body={"return_token_ids": True, **extra},
        )
    return raw.headers["x-moe-mesh-chat-template"], raw.parse().prompt_token_ids


@pytest.fixture(scope="module")
def created(checkpoint) -> Path:
    return checkpoint("mixtral")


@pytest.mark.parametrize("template", ["chatml", "llama3"])
async def test_chat_prompt_is_transformers_apply_chat_template(created, tmp_path, template) -> None:
    path = created if template == "chatml" else with_template(created, tmp_path / "c", LLAMA3)
    header, ids = await chat(path, MESSAGES)
    assert header == "checkpoint"
    assert ids == hf_ids(path, MESSAGES)
    # The templates' markers are single special tokens, not their characters.
    first = {"chatml": "<|im_start|>", "llama3": "<|endoftext|>"}[template]  # llama3: bos_token
    assert ids[0] == AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(first)


async def test_chat_template_kwargs_reach_the_template(created, tmp_path) -> None:
    path = with_template(created, tmp_path / "c", THINKING)
    _, plain = await chat(path, MESSAGES[1:2])
    _, thinking = await chat(path, MESSAGES[1:2], chat_template_kwargs={"enable_thinking": True})
    assert plain == hf_ids(path, MESSAGES[1:2])
    assert thinking == hf_ids(path, MESSAGES[1:2], enable_thinking=True) != plain


async def test_jinja_file_and_named_templates(created, tmp_path) -> None:
    named = [{"name": "tool_use", "template": "{{ raise_exception('no') }}"}]
    named.append({"name": "default", "template": LLAMA3})
    path = with_template(created, tmp_path / "named", named)
    assert (await chat(path, MESSAGES))[1] == hf_ids(path, MESSAGES)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    path = with_template(created, tmp_path / "file", "{{ raise_exception('unused') }}", LLAMA3)
    assert (await chat(path, MESSAGES))[1] == hf_ids(path, MESSAGES)


@pytest.mark.parametrize(
    "template, extra, param, words",
    [
        (ALTERNATE, {}, "messages", "roles must alternate"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", {}, "messages", "template"),
        ("{{ nowhere.field }}", {}, "messages", "undefined"),
        (LLAMA3, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
    ],
)
async def test_a_template_that_refuses_is_400_and_the_gateway_serves_on(
    created, tmp_path, template, extra, param, words
) -> None:
    path = with_template(created, tmp_path / "c", template)
    async with openai_client(path) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model="", messages=MESSAGES[2:3], max_tokens=1, extra_body=extra
            )
        assert e.value.body["param"] == param and words in e.value.body["message"]
        r = await c.completions.create(model="", prompt=[1, 2], max_tokens=1)
        assert r.choices[0].finish_reason == "length"


async def test_without_a_template_the_builtin_one_is_used_and_said(created, tmp_path) -> None:
    path = with_template(created, tmp_path / "c", None)
    header, ids = await chat(path, MESSAGES)
    assert header == "builtin"
    tok = AutoTokenizer.from_pretrained(path)
    assert ids == tok(builtin_chat_prompt(MESSAGES, True), add_special_tokens=False)["input_ids"]
    async with openai_client(path) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model="", messages=MESSAGES, extra_body={"chat_template_kwargs": {"x": 1}}
            )
    assert e.value.body["param"] == "chat_template_kwargs"


def test_a_template_that_does_not_compile_is_a_checkpoint_error(created, tmp_path) -> None:
    path = with_template(created, tmp_path / "c", "{% for m in messages %}")
    with pytest.raises(CheckpointError, match="chat template does not compile"):
        ChatTemplate.from_checkpoint(path)
