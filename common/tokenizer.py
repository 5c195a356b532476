"""Tokenization and incremental detokenization with stop strings.

Streamed text never splits a multi-byte character: a delta is held back while its decoding ends
in U+FFFD, and text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from common.chat_template import ChatTemplate
from common.errors import CheckpointError, InvalidArgumentError


class Tokenizer:
    """A checkpoint's tokenizer.json (HuggingFace `tokenizers` format)."""

    available = True

    def __init__(self, checkpoint_dir: str | Path) -> None:
        path = Path(checkpoint_dir) / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(f"cannot load tokenizer ({e})", file=str(path)) from e
        config = Path(checkpoint_dir) / "tokenizer_config.json"
        self.add_bos = (
            bool(json.loads(config.read_text()).get("add_bos_token", False))
            if config.exists()
            else False
        )
        self.chat_template = ChatTemplate.from_checkpoint(checkpoint_dir)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False` for a rendered chat template, which writes its own."""
        # encode_batch releases the GIL (encode does not) at the same speed, so a caller may run a long
        # text on a worker thread without stalling its event loop.
        special = self.add_bos and add_special_tokens
        return self._tok.encode_batch([text], add_special_tokens=special)[0].ids

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per process, kept for its life
    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs name tokens this way)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


# Why a gateway without a tokenizer refuses a text prompt.
NO_TOKENIZER = (
    "this server has no tokenizer (--skip-tokenizer-init): send token ids "
    "(prompt_token_ids, or a list of integers as the prompt)"
)


class NoTokenizer:
    """Stands in for the tokenizer of a gateway serving token ids only (--skip-tokenizer-init):
    text cannot be encoded, and tokens decode to nothing."""

    available = False
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidArgumentError("prompt", NO_TOKENIZER)

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def token_text(self, token_id: int) -> str:
        return ""


class TextStream:
    """Turns generated token ids into text deltas and applies stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] is the decode context of the next delta
        self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add new token ids; return the text that is now safe to show. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            # The last decoded chunk becomes the context of the next one: O(1) work per token,
            # and the window always starts on a character boundary.
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def take(self, ids: Sequence[int]) -> tuple[str, int]:
        """`push` token by token: the text, and how many of `ids` are the stream's, which is all
        of them unless a stop string ended it at one (the tokens after it are not)."""
        text = ""
        for n, token in enumerate(ids):
            text += self.push([token])
            if self.stopped:
                return text, n + 1
        return text, len(ids)

    def finish(self) -> str:
        """The text still held back, at the end of generation."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        for s in self.stop:
            idx = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if idx >= 0:
                self.text, self.stopped = self.text[:idx], True
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
