"""mode=dpo: preference rows (JSONL, Parquet; malformed ones counted and skipped), pairs
packed whole per rank, the checks before Ray, and examples/dpo end to end (real Ray,
rl-fsdp over gloo with its frozen reference, no engines)."""

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_launcher.config import DataConfig, DatasetConfig
from rl_launcher.config.loader import load_config
from rl_launcher.data.preference import pair_sample_from_row, pair_sequences
from rl_launcher.data.prompts import MalformedRow
from rl_launcher.data.sft import load_sft_dataset
from rl_launcher.loops.dpo import pair_rank_batches
from rl_launcher.session.model import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "dpo" / "config.yaml"
SPEC = DatasetConfig(path="unused.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "examples" / "quickstart" / "tokenizer")


def pair(prompt="3+4=", chosen="7", rejected="12"):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def test_a_pair_is_two_sequences_sharing_the_prompt(tokenizer):
    sample = pair_sample_from_row(pair(), SPEC, tokenizer=tokenizer, apply_chat_template=False)
    chosen, rejected = pair_sequences(sample)
    # character ids: '3'=4 '+'=11 '4'=5 '='=14 '7'=8 '1'=2 '2'=3, <eos>=0
    assert chosen.tokens == [4, 11, 5, 14, 8, 0] and chosen.response_length == 2
    assert rejected.tokens == [4, 11, 5, 14, 2, 3, 0] and rejected.response_length == 3
    for bad, why in (
        (pair(chosen=""), "non-empty texts"),
        (pair(rejected=None), "non-empty"),
        (pair(rejected="7"), "the same text"),
        ([1], "JSON object"),
    ):
        with pytest.raises(MalformedRow, match=why):
            pair_sample_from_row(bad, SPEC, tokenizer=tokenizer, apply_chat_template=False)


def test_jsonl_and_parquet_rows_with_malformed_ones_counted_and_skipped(
    tokenizer, tmp_path, caplog
):
    rows = [pair(), pair("1+1=", "2", "3"), {"prompt": "2+2="}, pair("1+2=", "3", "3")]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    table = pa.Table.from_pylist([pair(), pair("1+1=", "2", "3"), pair("0+0=", "0", "0")])
    parquet = tmp_path / "pairs.parquet"
    pq.write_table(table, parquet)
    data = DataConfig(train=[], apply_chat_template=False)
    # "3+4=": rejected "12" + EOS is 3 tokens > max_response_tokens=2: too long, not malformed
    for path, counts in ((jsonl, (5, 3, 1, 1)), (parquet, (3, 1, 1, 1))):
        dataset = load_sft_dataset(
            DatasetConfig(path=str(path)),
            data,
            tokenizer=tokenizer,
            max_response_tokens=2,
            to_sample=pair_sample_from_row,
        )
        stats = dataset.stats
        assert (stats.rows, stats.malformed, stats.too_long, stats.kept) == counts
        assert dataset.prompts[0].metadata["rejected_ids"] == [4, 0]  # "3" + EOS, of "1+1="
    assert "pairs.jsonl:3" in caplog.text  # file:line of the row without a pair


def test_two_ranks_get_whole_pairs_with_step_wide_denominators(tokenizer):
    rows = [pair(f"{a}+{a}=", str(2 * a), "9" * (a + 1)) for a in range(4)]
    pairs = [
        pair_sample_from_row(r, SPEC, tokenizer=tokenizer, apply_chat_template=False) for r in rows
    ]
    batches = pair_rank_batches(pairs, num_ranks=2)
    sequences = [seq for p in pairs for seq in pair_sequences(p)]
    seen = []
    for batch in batches:
        bounds = batch.cu_seqlens.tolist()
        rows_of = [batch.tokens[a:b].tolist() for a, b in itertools.pairwise(bounds)]
        assert len(rows_of) % 2 == 0
        for chosen, rejected in zip(rows_of[0::2], rows_of[1::2], strict=True):
            index = next(i for i, p in enumerate(pairs) if p.tokens == chosen)
            assert rejected == sequences[2 * index + 1].tokens
            seen.append(index)
        assert batch.global_num_seqs == 8.0
    assert sorted(seen) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--backend.name", "megatron"], "mode=dpo runs on backend.name=fsdp only"),
        (["--algorithm.num_minibatches", "2"], "algorithm.num_minibatches=1"),
        (["--rollout.dump_dir", "d"], "mode=dpo starts no engines"),
        (["--algorithm.dpo_beta", "0"], "dpo_beta"),
        (["--algorithm.dpo_loss", "hinge"], "dpo_loss"),
    ],
)
def test_config_refuses_what_dpo_cannot_do_before_ray(options, message):
    with pytest.raises(ValueError, match=message):
        load_config(["--config", str(EXAMPLE), *options])


@pytest.mark.integration
def test_example_raises_margin_and_accuracy_and_lowers_the_loss(tmp_path):
    from rl_launcher.cli import main
    from rl_launcher.infra.run_log import read_metrics

    argv = [
        "--config",
        str(EXAMPLE),
        "--num_steps",
        "12",
        "--logging.run_dir",
        str(tmp_path / "run"),
        "--checkpoint.interval",
        "0",
        "--model.tokenizer_path",
        str(ROOT / "examples/quickstart/tokenizer"),
        "--data.train.0.path",
        str(ROOT / "examples/dpo/data/pairs.jsonl"),
        "--eval.datasets.0.path",
        str(ROOT / "examples/dpo/data/pairs_eval.jsonl"),
    ]
    assert main(argv) == 0
    records = [r for r in read_metrics(tmp_path / "run") if "pref/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[:3], records[-3:]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    # the policy starts as the reference: margin 0, loss log 2, no pair ranked right
    assert records[0]["pref/margin"] == pytest.approx(0.0, abs=1e-6)
    assert records[0]["pref/loss"] == pytest.approx(0.6931, abs=1e-3)
    assert mean(last, "pref/margin") > mean(first, "pref/margin") + 0.05
    assert mean(last, "pref/accuracy") > mean(first, "pref/accuracy") + 0.2
    assert mean(last, "pref/loss") < mean(first, "pref/loss") - 0.02
    assert records[0]["dpo/chosen_length/mean"] == 2.0  # one digit and EOS
    # held-out pairs (every 10 steps and the last): all 25 of them, after the update
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/heldout/pref/accuracy" in r]
    assert [r["step"] for r in evals] == [10, 12]
    for r in evals:
        accuracy = r["eval/heldout/pref/accuracy"]
        assert accuracy * 25 == pytest.approx(round(accuracy * 25), abs=1e-4)  # k of 25 pairs
        assert r["eval/heldout/pref/margin"] > 0 and accuracy > 0.5
