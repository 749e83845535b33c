"""Prompt data: JSONL/Parquet reading, slicing, malformed rows, chat template, length filter,
mixing, epoch shuffling and exact resume."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.types import Sample
from rl_launcher.config import DataConfig, DatasetConfig
from rl_launcher.data import PromptSource, build_prompt_source, load_dataset
from rl_launcher.data.reader import parse_spec
from rl_launcher.data.source import DatasetStats, PromptDataset

ROWS = [{"prompt": f"question {i}", "label": str(i), "metadata": {"i": i}} for i in range(10)]


class CharTokenizer:
    """Tokenizer stand-in: one id per character and a chat template that tags roles."""

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, tools=None):
        assert tokenize is False
        head = f"<tools:{','.join(t['name'] for t in tools)}>" if tools else ""
        body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return head + body + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    return str(path)


def prompts(dataset):
    return [s.prompt for s in dataset.prompts]


def test_parse_spec():
    assert parse_spec("a/b.jsonl") == (parse_spec("a/b.jsonl")[0], None, None)
    assert parse_spec("b.jsonl@[2:5]")[1:] == (2, 5)
    assert parse_spec("b.jsonl@[-3:]")[1:] == (-3, None)
    with pytest.raises(ValueError, match=r"write path@\[start:stop\]"):
        parse_spec("b.jsonl@[1-2]")


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("cut", "expected"),
    [("", range(10)), ("@[2:5]", [2, 3, 4]), ("@[-3:]", [7, 8, 9]), ("@[:2]", [0, 1])],
)
def test_jsonl_and_parquet_read_the_same_rows_and_slices(tmp_path, suffix, cut, expected):
    writer = write_jsonl if suffix == "jsonl" else write_parquet
    path = writer(tmp_path / f"d.{suffix}", ROWS)
    dataset = load_dataset(DatasetConfig(path=path + cut), batch_rows=2)
    assert prompts(dataset) == [f"question {i}" for i in expected]
    assert [s.label for s in dataset.prompts] == [str(i) for i in expected]
    assert [s.metadata["row"] for s in dataset.prompts] == list(expected)
    assert dataset.prompts[0].metadata["i"] == next(iter(expected)) and dataset.name == "d"


def test_configurable_keys_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2", "answer": 4, "extra": {"a": 1}}])
    spec = DatasetConfig(
        path=path, prompt_key="question", label_key="answer", metadata_key="extra", name="arith"
    )
    (sample,) = load_dataset(spec).prompts
    assert (sample.prompt, sample.label, sample.metadata) == (
        "2+2",
        4,
        {"a": 1, "dataset": "arith", "row": 0},
    )
    with pytest.raises(ValueError, match=r"dataset .*nope\.jsonl' does not exist"):
        load_dataset(DatasetConfig(path=str(tmp_path / "nope.jsonl")))


MALFORMED = [
    '{"prompt": "good 1"}',
    '{"prompt": "bad json"',
    "",
    '["not", "an", "object"]',
    '{"question": "no prompt key"}',
    '{"prompt": "x", "metadata": [1]}',
    '{"prompt": [{"role": "user"}]}',
    '{"prompt": "x", "tools": "not a list"}',
    '{"prompt": "good 2"}',
]


def test_malformed_rows_are_counted_with_line_numbers(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(MALFORMED) + "\n")
    dataset = load_dataset(DatasetConfig(path=str(path)))
    assert prompts(dataset) == ["good 1", "good 2"]
    stats = dataset.stats
    assert (stats.rows, stats.kept, stats.malformed, stats.too_long) == (8, 2, 6, 0)
    lines = [example.split(": ")[0].rsplit(":", 1)[1] for example in stats.malformed_examples]
    assert lines == ["2", "4", "5", "6", "7", "8"]  # physical line numbers; line 3 is blank
    assert "invalid JSON" in stats.malformed_examples[0]
    assert "missing prompt key 'prompt'" in stats.malformed_examples[2]
    assert [s.metadata["row"] for s in dataset.prompts] == [0, 7]


def test_malformed_rows_raise_when_configured(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(MALFORMED) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:2: invalid JSON .*data.on_malformed=skip"):
        load_dataset(DatasetConfig(path=str(path)), on_malformed="raise")


def test_chat_template_tools_and_length_filter(tmp_path):
    rows = [
        {"prompt": "hi"},
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "tools": [{"name": "calc"}],
        },
        {"prompt": "a prompt far too long for the limit"},
    ]
    spec = DatasetConfig(path=write_jsonl(tmp_path / "c.jsonl", rows))
    dataset = load_dataset(spec, tokenizer=CharTokenizer(), max_prompt_tokens=40)
    first, second = dataset.prompts
    assert first.prompt == "<user>hi<assistant>" and first.tokens == [ord(c) for c in first.prompt]
    assert second.prompt == "<tools:calc><system>s<user>u<assistant>"
    assert (
        second.metadata["tools"] == [{"name": "calc"}]
        and second.metadata["messages"] == rows[1]["prompt"]
    )
    assert (dataset.stats.kept, dataset.stats.too_long) == (2, 1)
    plain = load_dataset(
        spec, tokenizer=CharTokenizer(), apply_chat_template=False, max_prompt_tokens=40
    )
    assert [s.prompt for s in plain.prompts] == ["hi", "a prompt far too long for the limit"]
    assert plain.stats.malformed == 1  # chat messages cannot be used without a template


def draw(source, count):
    return [
        (s.metadata["dataset"], s.metadata["row"], s.metadata["epoch"], s.group_index)
        for s in source.next_batch(count)
    ]


def make_source(tmp_path, *, weights=(1.0,), seed=3, shuffle=True, sizes=(7,)):
    specs = []
    for d, size in enumerate(sizes):
        path = write_jsonl(tmp_path / f"ds{d}.jsonl", [{"prompt": f"{d}-{i}"} for i in range(size)])
        specs.append(DatasetConfig(path=path, weight=weights[d]))
    return build_prompt_source(DataConfig(train=specs, shuffle=shuffle), seed=seed)


def test_epochs_visit_every_prompt_once_in_a_new_order(tmp_path):
    stream = draw(make_source(tmp_path), 21)
    epochs = [[row for _, row, epoch, _ in stream if epoch == e] for e in range(3)]
    assert all(sorted(rows) == list(range(7)) for rows in epochs)
    assert len({tuple(rows) for rows in epochs}) == 3  # reshuffled every epoch
    assert [g for *_, g in stream] == list(range(21))
    assert draw(make_source(tmp_path), 21) == stream  # same seed, same stream
    assert draw(make_source(tmp_path, seed=4), 21) != stream
    assert [row for _, row, _, _ in draw(make_source(tmp_path, shuffle=False), 9)] == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        0,
        1,
    ]


def test_mixture_follows_the_weights(tmp_path):
    stream = draw(make_source(tmp_path, weights=(3.0, 1.0), sizes=(5, 4)), 4000)
    share = sum(name == "ds0" for name, *_ in stream) / len(stream)
    assert abs(share - 0.75) < 0.03
    ds1 = [(row, epoch) for name, row, epoch, _ in stream if name == "ds1"]
    for e in range(ds1[-1][1]):  # every complete epoch of ds1 holds each of its rows once
        assert sorted(row for row, epoch in ds1 if epoch == e) == [0, 1, 2, 3]


@pytest.mark.parametrize("weights", [(1.0,), (2.0, 1.0)])
def test_resume_anywhere_continues_exactly(tmp_path, weights):
    sizes = (7, 3)[: len(weights)]
    total = 3 * 7 + 2
    uninterrupted = draw(make_source(tmp_path, weights=weights, sizes=sizes), total)
    for cut in range(total + 1):  # includes epoch boundaries (7, 14, 21 for one dataset)
        first = make_source(tmp_path, weights=weights, sizes=sizes)
        head = draw(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make_source(tmp_path, weights=weights, sizes=sizes)
        resumed.load_state_dict(state)
        assert head + draw(resumed, total - cut) == uninterrupted, f"resumed at {cut}"


def test_state_from_other_data_is_refused(tmp_path):
    state = make_source(tmp_path, sizes=(7,)).state_dict()
    other = make_source(tmp_path, sizes=(6,))
    with pytest.raises(ValueError, match="resume with the same data and seed"):
        other.load_state_dict(state)


def test_empty_dataset_is_refused(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"q": 1}\n')
    with pytest.raises(ValueError, match=r"has no usable prompts .*1 malformed"):
        PromptSource([load_dataset(DatasetConfig(path=str(path)))], [1.0], seed=0)


def tiny_hf_tokenizer():
    """A real transformers tokenizer built in memory (word level, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "[UNK]",
        "<|user|>",
        "<|system|>",
        "<|assistant|>",
        "<|tools|>",
        "what",
        "is",
        "2",
        "+",
        "calc",
        "be",
        "brief",
    ]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% if tools %}<|tools|> {% for t in tools %}{{ t.name }} {% endfor %}{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tokenizer


def test_chat_template_of_a_transformers_tokenizer(tmp_path):
    rows = [
        {"prompt": "what is 2 + 2"},
        {
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "2 + 2"},
            ],
            "tools": [{"name": "calc"}],
        },
    ]
    dataset = load_dataset(
        DatasetConfig(path=write_jsonl(tmp_path / "t.jsonl", rows)),
        tokenizer=tiny_hf_tokenizer(),
        max_prompt_tokens=8,
    )
    (plain,) = dataset.prompts  # the second renders to 10 tokens: filtered, counted
    assert plain.prompt == "<|user|> what is 2 + 2 <|assistant|>"
    assert plain.tokens == [1, 5, 6, 7, 8, 7, 3]
    assert dataset.stats.too_long == 1
    roomy = load_dataset(
        DatasetConfig(path=str(tmp_path / "t.jsonl")), tokenizer=tiny_hf_tokenizer()
    )
    assert (
        roomy.prompts[1].prompt == "<|tools|> calc <|system|> be brief <|user|> 2 + 2 <|assistant|>"
    )
    assert roomy.prompts[1].tokens == [4, 9, 2, 10, 11, 1, 7, 8, 7, 3]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    weights=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    seed=st.integers(0, 2**31),
    cut=st.integers(0, 40),
    shuffle=st.booleans(),
)
def test_resume_equals_uninterrupted_for_any_mixture(sizes, weights, seed, cut, shuffle):
    def fresh():
        datasets = [
            PromptDataset(f"d{d}", [Sample(prompt=f"{d}-{i}") for i in range(n)], DatasetStats())
            for d, n in enumerate(sizes)
        ]
        return PromptSource(datasets, weights[: len(sizes)], seed=seed, shuffle=shuffle)

    def take(source, count):
        return [(s.prompt, s.metadata["epoch"], s.group_index) for s in source.next_batch(count)]

    uninterrupted = take(fresh(), 40)
    first = fresh()
    head = take(first, cut)
    resumed = fresh()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + take(resumed, 40 - cut) == uninterrupted
