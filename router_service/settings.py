"""Router settings: one pydantic model, built once (CLI flags or MOE_ROUTER_* variables) and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    """Continuous-batching limits of one router's engine."""

    model_config = SettingsConfigDict(env_prefix="MOE_ROUTER_", extra="forbid")

    checkpoint: Path | None = Field(None, description="HuggingFace-layout checkpoint directory")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="compute dtype; auto keeps the checkpoint's dtype")
    max_num_seqs: int = Field(32, ge=1, le=4096, description="sequences in the running batch at most")
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens per sequence at most; "
                                      "default min(max_position_embeddings, 4096)")
    max_prefill_tokens: int = Field(2048, ge=1, description="prompt tokens admitted into one step at most "
                                    "(a longer single prompt still runs alone)")
