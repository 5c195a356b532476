"""The gateway's OpenAI-compatible HTTP API, through the real `openai` client and raw httpx, on a real mesh."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
import torch

from common.sampling import SamplingParams
from common.tokenizer import TextStream, Tokenizer
from gateway.balancer import RouterLostError
from gateway.core import TextRequest
from gateway.http_api import create_app
from gateway.router_client import Chunk
from router_service.build import build_local_engine
from router_service.settings import RouterSettings
from tests.support.fakes import FakeRouter, ScriptedRouter
from tests.support.fakes import core as fake_core
from tests.support.meshes import LocalMesh, local_mesh
from tests.support.net import asgi_post_scope
from tests.support.polling import eventually

# One mesh serves most tests of this module, so they share its event loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")

IDS = [11, 3, 250, 9, 31]
TEXT = "Hello wörld, naïve café"
N = 24
GREEDY = {
    "temperature": 0,
    "max_tokens": N,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}


def greedy(path: Path, prompt: tuple[int, ...], max_tokens: int = N) -> list[int]:
    """The in-process engine's greedy tokens, past EOS."""
    return reference(path, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@cache
def reference(path: Path, prompt: tuple[int, ...], **params) -> list[int]:
    """The in-process engine's tokens for SamplingParams(**params) (on a worker thread: the test
    already runs an event loop)."""
    engine = build_local_engine(RouterSettings(checkpoint=path))
    engine.add_request("ref", list(prompt), SamplingParams(**params))

    async def run() -> list[int]:
        out: list[int] = []
        while engine.has_unfinished():
            for o in await engine.step():
                assert o.error is None
                out += o.new_token_ids
        return out

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


def detokenized(path: Path, ids: list[int]) -> str:
    """The text the core makes of `ids` streamed one token at a time, as the router sends them.

    Not tokenizer.decode(ids): random models emit stray UTF-8 bytes, which the stream holds back
    (so a trailing partial character is dropped) instead of decoding to U+FFFD.
    """
    stream = TextStream(Tokenizer(path))
    return "".join(stream.push([t]) for t in ids) + stream.finish()


@pytest.fixture(scope="module")
def path(checkpoint) -> Path:
    return checkpoint("mixtral")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(path):
    async with local_mesh(path) as m:
        yield m


def client(mesh: LocalMesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.http_base_url + "/v1", api_key="unused", max_retries=0)


async def wait_idle(mesh: LocalMesh) -> None:
    """Until the router runs nothing and the gateway holds no admission place (a guard of 30 s)."""

    def idle() -> bool:
        return not (mesh.router.core.status().running or mesh.gateway.core.admission.in_flight)

    await eventually(idle, 30, "the request to give back its slot")


async def steps_to_idle(mesh: LocalMesh, since: int) -> int:
    """Engine steps from `since` (a status' count) until idle: with one request running, fewer
    than its max_tokens when leaving it aborted it instead of letting it run to its end."""
    await wait_idle(mesh)
    return mesh.router.core.status().steps - since


async def test_completions_give_the_engines_greedy_tokens(mesh, path) -> None:
    tok = Tokenizer(path)
    async with client(mesh) as c:
        for prompt, ids in [(IDS, IDS), (TEXT, tok.encode(TEXT))]:
            ref = greedy(path, tuple(ids))
            r = await c.completions.create(
                model=mesh.gateway.core.model.id, prompt=prompt, **GREEDY
            )
            choice = r.choices[0]
            assert choice.token_ids == ref and choice.text == detokenized(path, ref)
            assert (
                choice.finish_reason == "length"
                and r.object == "text_completion"
                and r.id.startswith("cmpl-")
            )
            usage = r.usage
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
                len(ids),
                N,
                len(ids) + N,
            )

            chunks = [
                ch
                async for ch in await c.completions.create(
                    model="",
                    prompt=prompt,
                    stream=True,
                    stream_options={"include_usage": True},
                    **GREEDY,
                )
            ]
            *deltas, usage = chunks
            assert sum((d.choices[0].token_ids for d in deltas), []) == ref
            assert "".join(d.choices[0].text for d in deltas) == choice.text
            assert [d.choices[0].finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [
                "length"
            ]
            assert all(d.object == "text_completion" and d.id == deltas[0].id for d in chunks)
            assert usage.choices == [] and (
                usage.usage.prompt_tokens,
                usage.usage.completion_tokens,
            ) == (len(ids), N)

        # OpenAI's batch form with a single prompt, and a stop string that ends the text early.
        r = await c.completions.create(model="", prompt=[IDS], **GREEDY)
        assert r.choices[0].token_ids == greedy(path, tuple(IDS))
        stop = r.choices[0].text[3:5]
        r = await c.completions.create(model="", prompt=IDS, stop=stop, **GREEDY)
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text

        # Sampling fields reach the engine: top_k=1 and min_p=1 are greedy at any temperature (the
        # latter but for exact ties); a seed repeats.
        sampled = {**GREEDY, "temperature": 1.0}
        for extension in ({"top_k": 1}, {"min_p": 1.0}):
            r = await c.completions.create(
                model="",
                prompt=IDS,
                **{**sampled, "extra_body": {**GREEDY["extra_body"], **extension}},
            )
            assert r.choices[0].token_ids == greedy(path, tuple(IDS)), extension
        a, b = [
            (await c.completions.create(model="", prompt=IDS, seed=7, **sampled))
            .choices[0]
            .token_ids
            for _ in range(2)
        ]
        assert a == b and len(a) == N


async def test_a_list_of_prompts_gives_a_choice_each_in_order_as_each_alone(mesh, path) -> None:
    """OpenAI's order, choice p * n + i for prompt p's i-th; each as the prompt alone gives it,
    sampled with a seed, whole and streamed; usage counts every prompt once."""
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 6, "n": 2}
    extra = {"extra_body": {"ignore_eos": True, "return_token_ids": True}}
    async with client(mesh) as c:
        for prompts in ([TEXT, "Once upon a time"], [IDS, [7, 8, 9]]):
            alone = [
                await c.completions.create(model="", prompt=q, **sampled, **extra) for q in prompts
            ]
            want = [choice.token_ids for r in alone for choice in r.choices]
            assert want[0] != want[2]  # the two prompts are told apart
            batch = await c.completions.create(model="", prompt=prompts, **sampled, **extra)
            assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
            assert [ch.token_ids for ch in batch.choices] == want
            assert [ch.text for ch in batch.choices] == [ch.text for r in alone for ch in r.choices]
            assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
            assert batch.usage.completion_tokens == 4 * 6
            stream = await c.completions.create(
                model="",
                prompt=prompts,
                stream=True,
                stream_options={"include_usage": True},
                **sampled,
                **extra,
            )
            streamed: dict[int, list[int]] = {}
            async for chunk in stream:
                for ch in chunk.choices:
                    streamed.setdefault(ch.index, []).extend(ch.token_ids)
                usage = chunk.usage
            assert [streamed[i] for i in range(4)] == want
            assert usage.prompt_tokens == batch.usage.prompt_tokens
    assert mesh.gateway.core.admission.in_flight == 0


async def test_a_field_nobody_defines_is_a_400_naming_it(mesh) -> None:
    async with client(mesh) as c:
        for call in (
            c.completions.create(model="", prompt=IDS, max_tokens=2, extra_body={"top_a": 0.1}),
            c.chat.completions.create(
                model="",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={"top_a": 0.1},
            ),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                await call
            assert e.value.body["param"] == "top_a" and "'top_a'" in e.value.body["message"]
        # OpenAI's own fields that cannot change the tokens are accepted. (It samples at the
        # default temperature 1, and an end-of-sequence token would end it after one.)
        r = await c.completions.create(
            model="", prompt=IDS, max_tokens=2, user="someone", extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 2


async def test_logprobs_1_returns_the_sampled_token_among_top_logprobs(mesh) -> None:
    """As OpenAI's completions: up to logprobs + 1 entries, the sampled token always among them
    (a hot temperature samples tokens that are not the most likely)."""
    async with client(mesh) as c:
        r = await c.completions.create(
            model="",
            prompt=IDS,
            max_tokens=16,
            temperature=3.0,
            seed=5,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 16
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the top


def hf_chat_ids(path: Path, messages: list[dict], **kwargs) -> list[int]:
    """transformers' apply_chat_template on the checkpoint's own tokenizer and template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


async def test_chat_completions_stream_and_not(mesh, path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    # `checkpoint create` ships a ChatML template: the prompt is exactly transformers' rendering.
    ids = hf_chat_ids(path, messages)
    assert ids[0] == Tokenizer(path).encode("<|im_start|>", False)[0]
    ref = greedy(path, tuple(ids), 8)
    async with client(mesh) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=mesh.gateway.core.model.id,
            messages=messages,
            temperature=0,
            max_completion_tokens=8,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert raw.headers["x-moe-mesh-chat-template"] == "checkpoint"
        r = raw.parse()
        assert r.prompt_token_ids == ids
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant" and r.choices[0].token_ids == ref
        assert (
            r.choices[0].message.content == detokenized(path, ref)
            and r.choices[0].finish_reason == "length"
        )
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)

        stream = await c.chat.completions.create(
            model="",
            messages=messages,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        *deltas, usage = [ch async for ch in stream]
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(d.choices[0].delta.content for d in deltas) == r.choices[0].message.content
        assert (
            deltas[-1].choices[0].finish_reason == "length" and usage.usage.completion_tokens == 8
        )
        assert all(d.object == "chat.completion.chunk" for d in deltas)

        # Text given as content parts renders the same prompt.
        parts = [
            {**messages[0]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ]
        again = await c.chat.completions.create(
            model="", messages=parts, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert again.choices[0].message.content == r.choices[0].message.content


async def test_logprobs_are_transformers_log_softmax_at_the_same_positions(mesh, path) -> None:
    from tests.support.hf import load

    messages = [{"role": "user", "content": "Hi there"}]
    chat_ids = hf_chat_ids(path, messages)
    async with client(mesh) as c:
        r = await c.completions.create(
            model="",
            prompt=IDS,
            max_tokens=6,
            temperature=0,
            logprobs=3,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        completion_ids, legacy = r.choices[0].token_ids, r.choices[0].logprobs
        # Streamed, sampled: a logprob is still the model's own, before temperature.
        stream = await c.chat.completions.create(
            model="",
            messages=messages,
            max_tokens=6,
            temperature=0.8,
            seed=3,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        chat_tokens, chat_lp = [], []
        async for chunk in stream:
            chat_tokens += chunk.choices[0].token_ids
            chat_lp += chunk.choices[0].logprobs.content
    model = load(path)
    for prompt, ids in ((IDS, completion_ids), (chat_ids, chat_tokens)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # the positions that chose ids
        if prompt is IDS:
            assert len(legacy.token_logprobs) == len(ids) == 6
            got = torch.tensor(legacy.token_logprobs)
            assert max(legacy.top_logprobs[0].values()) == pytest.approx(
                float(ref[0].max()), abs=1e-4
            )
            assert legacy.text_offset[0] == 0 and legacy.tokens[0] == Tokenizer(path).token_text(
                ids[0]
            )
        else:
            assert len(chat_lp) == len(ids) == 6
            got = torch.tensor([e.logprob for e in chat_lp])
            tops = torch.tensor([[t.logprob for t in e.top_logprobs] for e in chat_lp])
            assert torch.allclose(tops, ref.topk(2).values, atol=1e-4)
        want = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4), (got, want)


async def test_n_choices_with_a_seed_are_reproducible(mesh, path) -> None:
    async with client(mesh) as c:

        async def three() -> list[list[int]]:
            r = await c.completions.create(
                model="",
                prompt=IDS,
                n=3,
                seed=7,
                temperature=1.0,
                max_tokens=8,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert [ch.index for ch in r.choices] == [0, 1, 2]
            assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(IDS)
            return [ch.token_ids for ch in r.choices]

        first = await three()
        assert first == await three()
        assert len({tuple(t) for t in first}) > 1, "three seeds drew the same tokens"
        # Choice i is the request with seed 7 + i, as the engine draws it alone.
        for i, tokens in enumerate(first):
            sampled = {"temperature": 1.0, "ignore_eos": True}
            assert tokens == reference(path, tuple(IDS), max_tokens=8, seed=7 + i, **sampled), i
        # Streamed, the choices interleave by index and add up to the same tokens.
        stream = await c.completions.create(
            model="",
            prompt=IDS,
            n=3,
            seed=7,
            temperature=1.0,
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for chunk in stream:
            streamed[chunk.choices[0].index] += chunk.choices[0].token_ids
        assert [streamed[i] for i in range(3)] == first
    await wait_idle(mesh)


async def test_echo_and_penalties_over_http(mesh, path) -> None:
    async with client(mesh) as c:
        r = await c.completions.create(
            model="",
            prompt=TEXT,
            max_tokens=4,
            temperature=0,
            echo=True,
            extra_body={"ignore_eos": True},
        )
        ref = greedy(path, tuple(Tokenizer(path).encode(TEXT)), 4)
        assert r.choices[0].text == TEXT + detokenized(path, ref)
        plain = await c.completions.create(model="", prompt=IDS, **GREEDY)
        assert plain.choices[0].token_ids == greedy(path, tuple(IDS))
        penalties = {"presence_penalty": 2.0, "frequency_penalty": 2.0}
        penalized = await c.completions.create(model="", prompt=IDS, **penalties, **GREEDY)
        want = reference(
            path, tuple(IDS), max_tokens=N, temperature=0.0, ignore_eos=True, **penalties
        )
        assert penalized.choices[0].token_ids == want != plain.choices[0].token_ids
        # The first greedy token ends the output once min_tokens are out, and not before.
        stop = plain.choices[0].token_ids[0]
        held = await c.completions.create(
            model="",
            prompt=IDS,
            max_tokens=N,
            temperature=0,
            extra_body={"min_tokens": 5, "stop_token_ids": [stop], "return_token_ids": True},
        )
        want = reference(
            path, tuple(IDS), max_tokens=N, temperature=0.0, min_tokens=5, stop_token_ids=(stop,)
        )
        assert held.choices[0].token_ids == want and held.usage.completion_tokens == len(want)
        assert len(want) >= 5 and stop not in want[:5]


async def test_an_unknown_model_is_404_model_not_found(mesh) -> None:
    async with client(mesh) as c:
        for call in (
            c.completions.create(model="gpt-4", prompt=IDS, max_tokens=2),
            c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}]),
        ):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
            assert "gpt-4" in e.value.body["message"]


async def test_served_model_names_are_listed_accepted_and_answered_with(path) -> None:
    gw = fake_core(path, [FakeRouter("a:1")], served_model_name=["moe", "moe-alias"])
    transport = httpx.ASGITransport(app=create_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as h:
        listed = (await h.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["moe", "moe-alias"]
        r = await h.post("/v1/completions", json=completion(model="moe-alias"))
        assert r.status_code == 200 and r.json()["model"] == "moe"
        r = await h.post("/v1/completions", json=completion(model="m"))  # the router's own id
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (await h.get("/metrics")).status_code == 404  # this core collects no metrics


async def test_models_and_health(mesh) -> None:
    async with client(mesh) as c:
        models = [m async for m in c.models.list()]
    info = mesh.gateway.core.model
    assert [m.id for m in models] == [info.id] and models[0].object == "model"
    assert models[0].max_model_len == info.max_model_len == 512
    async with client(mesh) as c:  # one model by name, as the openai client retrieves it
        assert (await c.models.retrieve(info.id)).max_model_len == 512
        with pytest.raises(openai.NotFoundError) as e:
            await c.models.retrieve("no/such-model")
        assert e.value.body["code"] == "model_not_found" and repr(info.id) in e.value.message
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        assert (await h.get("/health/live")).status_code == 200
        assert (await h.get("/health/ready")).status_code == 200
        assert (await h.get("/health")).status_code == 200
        assert (await h.post("/v1/completions", json=completion())).status_code == 200
        metrics = await h.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith(
            "text/plain"
        )
        assert "gen_ai_server_request_duration_seconds_count" in metrics.text, metrics.text[:500]
        assert (await h.get("/openapi.json")).status_code == 200
        nowhere = await h.get("/v1/nowhere")
        assert nowhere.status_code == 404 and "error" in nowhere.json()


def completion(**fields) -> dict:
    return {"model": "", "prompt": IDS, "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


BAD = [  # (endpoint, JSON body or raw bytes, the field the error must name)
    ("completions", completion(prompt=""), "prompt"),
    ("completions", completion(prompt=[]), "prompt"),
    ("completions", completion(prompt=[5] * 600), "prompt"),
    ("completions", completion(prompt=[5, 512]), "prompt"),
    ("completions", completion(prompt=[-1]), "prompt"),
    ("completions", completion(prompt=[[1], []]), "prompt"),
    ("completions", completion(prompt=[[1], [512]]), "prompt"),
    ("completions", completion(prompt=[[1]] * 65), "prompt"),  # max_prompts
    ("completions", completion(prompt=["a"] * 40, n=2), "prompt"),  # 80 > max_in_flight
    ("completions", completion(prompt=["a", 5]), "prompt"),
    ("completions", completion(nucleus=0.9), "nucleus"),  # no such field
    ("chat/completions", chat(guided_json={}), "guided_json"),
    ("completions", completion(prompt=5), "prompt"),
    ("completions", {"model": "", "max_tokens": 2}, "prompt"),
    ("completions", completion(max_tokens=0), "max_tokens"),
    ("completions", completion(max_tokens=5000), "max_tokens"),
    ("completions", completion(max_tokens=510), "max_tokens"),  # 5 prompt tokens + 510 > 512
    ("completions", completion(max_tokens=0, stream=True), "max_tokens"),  # JSON error, not SSE
    ("completions", completion(max_tokens="ten"), "max_tokens"),
    ("completions", completion(temperature=-0.5), "temperature"),
    ("completions", completion(temperature="hot"), "temperature"),
    ("completions", completion(top_p=0), "top_p"),
    ("completions", completion(top_p=1.5), "top_p"),
    ("completions", completion(top_k=-1), "top_k"),
    ("completions", completion(min_p=-0.1), "min_p"),
    ("completions", completion(min_p=2), "min_p"),
    ("completions", completion(min_p="high"), "min_p"),
    ("completions", completion(seed=-1), "seed"),
    ("completions", completion(stop=5), "stop"),
    ("completions", completion(stop_token_ids=[9999]), "stop_token_ids"),
    ("completions", completion(stream="yes"), "stream"),
    ("completions", b'{"prompt": [1, 2', None),
    ("completions", b"[1, 2]", None),
    ("chat/completions", chat(messages=[]), "messages"),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (
        "chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages",
    ),
    ("chat/completions", chat(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
    ("chat/completions", chat(max_tokens=0, stream=True), "max_tokens"),
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    # Lone surrogates are valid JSON escapes but not text.
    ("completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("completions", b'{"prompt": "hi", "stop": ["a\\udfff"], "max_tokens": 2}', "stop"),
    ("completions", b'{"prompt": "hi", "request_id": "\\ud800", "max_tokens": 2}', "request_id"),
    (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
        "messages",
    ),
    (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
        "messages",
    ),
    # Limits, checked before any heavy work.
    ("completions", completion(stop=["x"] * 33), "stop"),
    ("completions", completion(stop="x" * 257), "stop"),
    ("completions", completion(stop_token_ids=[1] * 33), "stop_token_ids"),
    ("completions", completion(request_id="r" * 100_000), "request_id"),
    ("completions", completion(model="m" * 20_000), "model"),
    ("chat/completions", chat(messages=[{"role": "user", "content": ""}] * 2049), "messages"),
    ("completions", completion(n=0), "n"),
    ("completions", completion(n=17), "n"),
    ("completions", completion(presence_penalty=2.5), "presence_penalty"),
    ("chat/completions", chat(frequency_penalty=-2.5), "frequency_penalty"),
    ("completions", completion(repetition_penalty=0.0), "repetition_penalty"),
    ("completions", completion(min_tokens=3), "min_tokens"),  # max_tokens is 2
    ("completions", completion(logprobs=21), "logprobs"),
    ("completions", completion(logprobs=2, echo=True), "echo"),
    ("chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
]


@pytest.mark.parametrize(
    "endpoint, body, param", BAD, ids=[f"{e}:{p}:{i}" for i, (e, _, p) in enumerate(BAD)]
)
async def test_bad_input_is_400_naming_the_field(mesh, endpoint, body, param) -> None:
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        url = f"/v1/{endpoint}"
        r = await (
            h.post(url, content=body, headers={"content-type": "application/json"})
            if isinstance(body, bytes)
            else h.post(url, json=body)
        )
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert (
            error["type"] == "invalid_request_error"
            and error["param"] == param
            and error["message"]
        ), error
        assert (await h.get("/health/live")).status_code == 200
        good = await h.post(url, json=completion() if endpoint == "completions" else chat())
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert mesh.gateway.core.admission.in_flight == 0


async def test_a_bad_prompt_is_explained_in_the_form_it_was_sent(mesh) -> None:
    """Not why it is none of the four forms a prompt may take (a 600-id prompt once also read
    "Input should be a valid string" and two 64-item limits)."""
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        long = await h.post("/v1/completions", json=completion(prompt=[5] * 600))
        odd = await h.post("/v1/completions", json=completion(prompt=5))
    message = long.json()["error"]["message"]
    assert "at most 512 items" in message and "string" not in message and "64" not in message
    assert odd.json()["error"]["message"] == (
        "prompt: must be a string, a list of token ids, or a list of either"
    )


async def test_a_body_that_is_not_a_json_object_says_what_was_sent(mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        empty = await h.post("/v1/completions", headers={"content-type": "application/json"})
        form = await h.post("/v1/completions", data={"prompt": "hi"})  # curl -d's default
    assert empty.status_code == form.status_code == 400
    assert "(this request: an empty body; content type application/json)" in empty.text
    assert "content type application/x-www-form-urlencoded)" in form.text, form.text


async def test_a_large_body_is_413_at_once_while_small_requests_are_served(mesh) -> None:
    """No body-size limit and tokenization on the event loop once let a 10 MB prompt stall every request ~11 s."""
    huge = json.dumps({"prompt": "hello world " * 900_000, "max_tokens": 2}).encode()  # 10.8 MB
    large = json.dumps(
        {"prompt": "hello world " * 120_000, "max_tokens": 2}
    ).encode()  # 1.4 MB: under the limit

    async def chunked(body: bytes):
        for i in range(0, len(body), 2**16):
            yield body[i : i + 2**16]

    async with httpx.AsyncClient(base_url=mesh.http_base_url, timeout=60) as h:

        async def post(content) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = await h.post(
                "/v1/completions", content=content, headers={"content-type": "application/json"}
            )
            return r, time.monotonic() - t0

        for content, status in [(huge, 413), (chunked(huge), 413), (large, 400)]:
            task = asyncio.create_task(post(content))
            await asyncio.sleep(0.01)
            small = [await post(json.dumps(completion()).encode()) for _ in range(3)]
            for s, elapsed in small:
                assert s.status_code == 200 and elapsed < 1.0, elapsed
            r, _ = await task
            assert r.status_code == status, r.text
        r, elapsed = await post(huge)
        error = r.json()["error"]
        assert (
            elapsed < 1.0
            and error["code"] == "request_too_large"
            and "4194304 bytes" in error["message"]
        )
        large_error = (await post(large))[0].json()["error"]
        assert large_error["param"] == "prompt" and "context length" in large_error["message"]


async def test_a_request_id_in_flight_cannot_be_reused_until_it_ends(mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        body = completion(request_id="twice", max_tokens=400, ignore_eos=True, stream=True)
        async with h.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            second = await h.post("/v1/completions", json=completion(request_id="twice"))
            assert second.status_code == 409, second.text
            error = second.json()["error"]
            assert (
                error["code"] == "already_exists"
                and error["param"] == "request_id"
                and "twice" in error["message"]
            )
        await wait_idle(mesh)
        again = await h.post("/v1/completions", json=completion(request_id="twice"))
        assert again.status_code == 200 and again.json()["id"] == "cmpl-twice"


async def test_without_max_tokens_a_prompt_near_the_context_gets_what_is_left(mesh) -> None:
    n = mesh.gateway.core.model.max_model_len - 3  # the 16-token default would not fit
    async with client(mesh) as c:
        r = await c.completions.create(model="", prompt=[5] * n, temperature=0)
    assert r.usage.completion_tokens <= 3 and r.usage.prompt_tokens == n


async def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(mesh) -> None:
    """As OpenAI's and vLLM's chat do; not the 16 tokens of a completion without max_tokens."""
    context = mesh.gateway.core.model.max_model_len
    async with client(mesh) as c:
        r = await c.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "hi " * ((context - 120) // 2)}],
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert r.usage.prompt_tokens + r.usage.completion_tokens == context
    assert r.usage.completion_tokens > 16 and r.choices[0].finish_reason == "length"


async def test_openai_client_sees_bad_request_with_param(mesh) -> None:
    async with client(mesh) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="", prompt=IDS, n=99)
        assert e.value.status_code == 400 and e.value.param == "n"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model="", messages=[{"role": "user", "content": "hi"}], top_p=1.5, stream=True
            )
        assert e.value.param == "top_p"


async def test_overload_gets_429_with_retry_after_and_accepted_requests_complete(path) -> None:
    ref = greedy(path, tuple(IDS), 64)  # long enough that the burst arrives while the first two run
    async with local_mesh(path, max_in_flight=1, max_queued=1) as m, client(m) as c:

        async def one() -> tuple[float, object]:
            t0 = time.monotonic()
            try:
                r = await c.completions.create(model="", prompt=IDS, **{**GREEDY, "max_tokens": 64})
            except openai.RateLimitError as e:
                r = e
            return time.monotonic() - t0, r

        results = await asyncio.gather(*(one() for _ in range(20)))  # 10x the 2 places
        accepted = [r for _, r in results if not isinstance(r, openai.RateLimitError)]
        rejected = [(dt, r) for dt, r in results if isinstance(r, openai.RateLimitError)]
        assert len(accepted) >= 2 and len(rejected) >= 10, (len(accepted), len(rejected))
        assert all(
            r.choices[0].token_ids == ref and r.choices[0].finish_reason == "length"
            for r in accepted
        )
        # Refused at once, not after waiting for a place: sooner than any accepted request took.
        quickest = min(dt for dt, r in results if not isinstance(r, openai.RateLimitError))
        for dt, e in rejected:
            assert e.status_code == 429 and e.response.headers["retry-after"] == "1"
            assert dt < quickest
            assert e.body["code"] == "resource_exhausted"
        assert m.gateway.core.admission.rejected == len(rejected)
        await wait_idle(m)
        r = await c.completions.create(model="", prompt=IDS, **GREEDY)
        assert r.choices[0].token_ids == ref[:N]


async def test_streamed_choices_are_admitted_together_so_concurrent_ones_never_deadlock(
    path,
) -> None:
    """Each streamed response's n choices take their places at once: two responses cannot each
    hold one place while waiting for the other's (which hung them until their deadline)."""
    ref = greedy(path, tuple(IDS), 4)
    async with local_mesh(path, max_in_flight=2, max_queued=8) as m, client(m) as c:

        async def streamed(n: int) -> dict[int, list[int]]:
            stream = await c.completions.create(
                model="", prompt=IDS, n=n, stream=True, **{**GREEDY, "max_tokens": 4}
            )
            got: dict[int, list[int]] = {}
            async for chunk in stream:
                got.setdefault(chunk.choices[0].index, []).extend(chunk.choices[0].token_ids)
            return got

        done = await asyncio.wait_for(asyncio.gather(*(streamed(2) for _ in range(4))), 60)
        assert done == [{0: ref, 1: ref}] * 4
        with pytest.raises(openai.BadRequestError) as e:
            await streamed(3)
        assert e.value.body["param"] == "n" and "max_in_flight=2" in e.value.body["message"]
        await wait_idle(m)
        assert m.gateway.core.admission.in_flight == 0


async def test_client_leaving_a_stream_frees_the_router_slot(mesh) -> None:
    since = mesh.router.core.status().steps
    async with client(mesh) as c:
        stream = await c.completions.create(  # a penalty: no decode bursts, a step a token
            model="",
            prompt=IDS,
            max_tokens=400,
            stream=True,
            presence_penalty=0.5,
            extra_body={"ignore_eos": True},
        )
        chunks = aiter(stream)
        got = [await anext(chunks), await anext(chunks)]
        assert all(ch.choices[0].finish_reason is None for ch in got)
        assert mesh.router.core.status().running == 1
        await stream.close()
        assert await steps_to_idle(mesh, since) < 400  # each step one token of this request


async def test_client_leaving_a_non_streaming_request_frees_the_router_slot(mesh) -> None:
    since = mesh.router.core.status().steps
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        task = asyncio.create_task(
            h.post(  # a penalty: no decode bursts, so a step a token, and it runs long enough
                "/v1/completions",
                json=completion(max_tokens=500, ignore_eos=True, presence_penalty=0.5),
            )
        )
        await eventually(lambda: mesh.router.core.status().running, 30, "the request to run")
        task.cancel()  # closes the connection mid-request
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await steps_to_idle(mesh, since) < 500  # each step one token of this request


async def test_sse_wire_format(mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        async with h.stream(
            "POST", "/v1/completions", json=completion(stream=True, max_tokens=3)
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            body = (await r.aread()).decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )


async def test_null_fields_count_as_absent(mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
        r = await h.post(
            "/v1/completions", json=completion(stop=None, n=None, stream=None, seed=None, user=None)
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
            "stop",
            "length",
        )


async def test_deadline_is_504_before_streaming_and_an_error_event_after(path, monkeypatch) -> None:
    # Op by op, 500 tokens outlast the 0.3 s deadline; float32 steps in one call finished them.
    monkeypatch.setenv("MOE_MESH_FUSED_DECODE", "off")
    long = completion(max_tokens=500, ignore_eos=True)
    async with (
        local_mesh(path, request_timeout_s=0.3) as m,
        httpx.AsyncClient(base_url=m.http_base_url) as h,
    ):
        r = await h.post("/v1/completions", json=long)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text

        async with h.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200  # the deadline passes after the status line went out
            events = [line async for line in r.aiter_lines() if line]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "deadline_exceeded"
        assert events[-1] == "data: [DONE]"
        async with client(m) as c:
            with pytest.raises(openai.APIError) as e:
                async for _ in await c.completions.create(
                    model="",
                    prompt=IDS,
                    max_tokens=500,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    pass
            assert e.value.code == "deadline_exceeded"
        await wait_idle(m)
        assert (await h.get("/health/live")).status_code == 200
        assert (await h.post("/v1/completions", json=completion())).status_code == 200


# -- failure paths, on a core over fake routers ----------------------------------------------------


class BrokenRouter(ScriptedRouter):
    async def generate(self, request, timeout_s, trace_context=None):
        raise RuntimeError("bug near 10.1.2.3:50051")
        yield  # an async generator, like the real client


@pytest.mark.parametrize("stream", [False, True])
async def test_no_router_is_503_and_a_bug_is_500_without_internals(path, stream) -> None:
    """Streamed too: a generation that fails before its first token is an HTTP status, not a 200
    with an error event, so clients (the openai one retries 5xx) can act on it."""
    for routers, status, code in [
        ([], 503, "unavailable"),
        ([ScriptedRouter("a:1", refuses=True)], 503, "unavailable"),
        ([BrokenRouter("a:1")], 500, "internal"),
    ]:
        transport = httpx.ASGITransport(
            app=create_app(fake_core(path, routers)), raise_app_exceptions=False
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as h:
            r = await h.post("/v1/completions", json=completion(stream=stream))
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
        assert "10.1.2.3" not in r.text and "a:1" not in r.text


async def test_a_client_leaving_while_queued_is_499_and_frees_its_place(path) -> None:
    gate = asyncio.Event()
    gw = fake_core(path, [FakeRouter("a:1", gate)], max_in_flight=1, max_queued=2)
    app = create_app(gw)
    holder = asyncio.create_task(
        gw.complete(TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2)))
    )
    left = asyncio.Event()
    body = json.dumps(completion()).encode()
    received = []

    async def receive() -> dict:
        if not received:
            received.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = asgi_post_scope("/v1/completions", body)
    call = asyncio.create_task(app(scope, receive, send))
    await eventually(lambda: gw.admission.queued or call.done(), 30, "the request to queue")
    assert not call.done()
    left.set()
    await asyncio.wait_for(call, 2)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert gw.admission.queued == 0 and gw.admission.in_flight == 1  # only the holder
    gate.set()
    await holder
    assert gw.admission.in_flight == 0


async def test_ready_is_503_while_draining_and_admitted_streams_finish(path, monkeypatch) -> None:
    # Op by op, the stream outlasts the checks below; float32 steps in one call finished its 300
    # tokens before the last of them in a fresh-clone run, and the stopped gateway refused it.
    monkeypatch.setenv("MOE_MESH_FUSED_DECODE", "off")
    async with local_mesh(path, grace_s=10) as m, httpx.AsyncClient(base_url=m.http_base_url) as h:
        body = completion(max_tokens=300, ignore_eos=True, stream=True, return_token_ids=True)
        async with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            events = [await anext(lines)]
            stopping = asyncio.create_task(m.gateway.stop())
            await eventually(lambda: m.gateway.core.draining, 5, "the gateway to start draining")
            assert not stopping.done()  # still draining the stream
            async with httpx.AsyncClient(base_url=m.http_base_url) as fresh:  # a new connection
                ready = await fresh.get("/health/ready")
                assert ready.status_code == 503
                refused = await fresh.post("/v1/completions", json=completion())
                assert (
                    refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
                )
                assert (await fresh.get("/health/live")).status_code == 200
            events += [line async for line in lines if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 300
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        await asyncio.wait_for(stopping, 5)


async def test_skip_tokenizer_init_serves_token_ids_and_refuses_text(path, tmp_path) -> None:
    from common.errors import CheckpointError
    from common.tokenizer import NoTokenizer
    from gateway.app import _tokenizer
    from gateway.core import GatewayCore, ModelInfo
    from gateway.settings import GatewaySettings

    bare = tmp_path / "no-tokenizer"  # a checkpoint directory without tokenizer files
    bare.mkdir()
    (bare / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="tokenizer"):
        _tokenizer(GatewaySettings(checkpoint=bare, routers=["a:1"]))
    s = GatewaySettings(checkpoint=bare, routers=["a:1"], skip_tokenizer_init=True)
    assert isinstance(tokenizer := _tokenizer(s), NoTokenizer)
    core = GatewayCore(s, tokenizer, [FakeRouter("a:1")], ModelInfo("m", "mixtral", 512, 512))
    transport = httpx.ASGITransport(app=create_app(core))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as h:
        r = await h.post("/v1/completions", json=completion(return_token_ids=True))
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["token_ids"] == [5, 6] and r.json()["choices"][0]["text"] == ""
        )
        for endpoint, body, param in [
            ("completions", completion(prompt="hello"), "prompt"),
            ("chat/completions", chat(), "messages"),
            ("completions", completion(stop=["x"]), "stop"),
        ]:
            r = await h.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "tokenizer" in r.json()["error"]["message"]


async def test_a_queued_high_priority_request_is_served_before_an_earlier_low_one(path) -> None:
    gate = asyncio.Event()
    router = FakeRouter("a:1", gate)
    gw = fake_core(path, [router], max_in_flight=1, max_queued=4)
    transport = httpx.ASGITransport(app=create_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as h:

        async def post(request_id: str, priority: int | None = None) -> None:
            body = completion(request_id=request_id, priority=priority)
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text

        calls = [asyncio.create_task(post("holder"))]
        await eventually(lambda: router.served == ["holder"], what="the holder to run")
        calls.append(asyncio.create_task(post("low", -5)))
        await eventually(lambda: gw.admission.queued == 1, what="the low one to queue")
        calls.append(asyncio.create_task(post("high", 5)))
        await eventually(lambda: gw.admission.queued == 2, what="the high one to queue")
        gate.set()
        await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert router.served == ["holder", "high", "low"]


class StopsAfterMinTokens(ScriptedRouter):
    """A model that would stop at once: each call streams its `min_tokens` tokens, then an end of
    sequence (finish "stop"). Token at absolute position p is 5 + p, as in ScriptedRouter. The first
    call to any router of `deaths` (shared) dies after `dies_after` tokens, as a killed router."""

    def __init__(self, address: str, deaths: list[int], dies_after: int) -> None:
        super().__init__(address, dies_after=dies_after)
        self.deaths = deaths

    async def generate(self, request, timeout_s, trace_context=None):
        self.calls.append(request)
        start, n = len(request.prompt_token_ids), request.params.min_tokens + 1
        for i in range(n):
            if self.deaths and i == self.dies_after:
                self.deaths.pop()
                raise RouterLostError("UNAVAILABLE: Stream removed")
            yield Chunk([5 + start + i], "stop" if i == n - 1 else None, start, i + 1)
            await asyncio.sleep(0)


async def test_after_a_failover_min_tokens_counts_the_tokens_already_sent(path) -> None:
    """min_tokens=6 and the router dies after 3: the next one owes 3 more, not 6, so the client
    gets the same 6 tokens and stop as from an undisturbed run."""
    body = completion(prompt=IDS, max_tokens=20, min_tokens=6, return_token_ids=True)
    results = []
    for deaths in ([], [1]):
        planned = len(deaths)
        routers = [StopsAfterMinTokens(a, deaths, dies_after=3) for a in ("a:1", "b:1")]
        transport = httpx.ASGITransport(app=create_app(fake_core(path, routers)))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as h:
            r = await h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert sum(len(router.calls) for router in routers) == 1 + planned
        assert not deaths  # the planned death happened
        choice = r.json()["choices"][0]
        results.append((choice["token_ids"], choice["finish_reason"], r.json()["usage"]))
    undisturbed = [5 + len(IDS) + i for i in range(7)]
    assert results[0][:2] == (undisturbed, "stop")
    assert results[1] == results[0]
