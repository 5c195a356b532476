"""The byte-level BPE tokenizer of created checkpoints, trained on a small built-in corpus.

Deterministic for a given vocabulary size, and every byte is in the vocabulary, so any UTF-8 text
round-trips (no <unk>).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"  # ids 0 and 1; EOS doubles as BOS
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ids 2 and 3: the chat template's turn markers

# ChatML, as Qwen's instruct checkpoints write it: what `moe-mesh checkpoint create` ships.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_PROSE = """\
The harbour was quiet in the early morning, and the fishing boats rocked gently against the old stone pier. A gull circled twice above the lighthouse before settling on a post, watching the nets being hauled in. Somewhere up the hill a radio played a song about rivers, distant mountains and the people who leave home.
Mixture-of-experts models send every token to a small number of specialised feed-forward networks. A learned router scores each expert, keeps the best few, and mixes their outputs with the normalised scores. Because only a fraction of the weights is used for any one token, such a model can be very large and still be cheap to run.
In a serving system the experts may live on different machines. The router decides where each hidden state should go, gathers the answers, and continues with the next layer. Latency depends on how evenly the traffic is spread: when a handful of experts are popular, their servers become the bottleneck while the others sit idle.
She opened the window and let the cold air into the kitchen. The kettle was already singing, the bread was still warm, and on the table lay a letter she had not yet found the courage to read. Outside, the children were arguing about whose turn it was to feed the chickens.
Numbers such as 3.14159, 2048, 1e-5 and 65,536 appear in configuration files, logs and error messages. A request might carry an identifier like req-7f3a9c, a timeout of 30 seconds, and a budget of 512 new tokens. Good tools print clear messages when something goes wrong and tell you exactly which value was rejected.
Autumn came early that year. The maple leaves turned red before the end of September, the river rose after a week of rain, and the market filled with apples, pumpkins and jars of dark honey. Travellers stopped at the inn by the bridge to dry their coats and tell stories of the road.
"""


def _pseudo_sentences(n: int, seed: int = 1234) -> Iterator[str]:
    # Prose alone runs out of merges long before 8k tokens; a seeded Zipf-ish stream of invented words fills in.
    rng = random.Random(seed)
    syllables = [
        o + v + c
        for o in (
            "",
            "b",
            "br",
            "c",
            "ch",
            "d",
            "dr",
            "f",
            "g",
            "gr",
            "h",
            "j",
            "k",
            "l",
            "m",
            "n",
            "p",
            "pl",
            "qu",
            "r",
            "s",
            "sh",
            "st",
            "t",
            "th",
            "tr",
            "v",
            "w",
            "z",
        )
        for v in ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "oo")
        for c in ("", "", "n", "r", "s", "t", "l", "m", "nd", "ck", "st", "x")
    ]
    lexicon = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(8000)
    ]
    for _ in range(n):
        words = (
            lexicon[min(int(rng.paretovariate(0.8)) - 1, len(lexicon) - 1)]
            if rng.random() < 0.5
            else rng.choice(lexicon)
            for _ in range(12)
        )
        yield " ".join(words).capitalize() + "."


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE (deterministic for a given vocab size) and return it serialised."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, IM_START, IM_END],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # every byte: no <unk>
    corpus = _PROSE.splitlines() * 4  # repeated so English merges outrank the invented words
    tok.train_from_iterator([*corpus, *_pseudo_sentences(max(0, vocab_size - 512) * 3)], trainer)
    return tok.to_str(pretty=True)
