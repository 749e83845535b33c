"""Prompt data: readers for JSONL and Parquet, prompt formatting, the mixed, shuffled and
resumable :class:`~rl_launcher.data.source.PromptSource`."""

from rl_launcher.data.source import PromptSource, build_prompt_source, load_dataset

__all__ = ["PromptSource", "build_prompt_source", "load_dataset"]
