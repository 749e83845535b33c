"""A shipped ``tokenizers`` tokenizer survives the trip through a model directory: loaded
back from ``initial_model`` or an HF export (which hold a config.json), it must tokenize
exactly as the original, not as the tokenizer class of the config's model_type."""

from pathlib import Path

from rl_launcher.config import ModelConfig
from rl_launcher.session.model import load_tokenizer, prepare_model

ROOT = Path(__file__).resolve().parents[3]
MULTITURN = ROOT / "examples" / "multiturn" / "tokenizer"


def test_the_tokenizer_reloaded_from_the_model_directory_is_the_original(tmp_path):
    init = {
        "model_type": "qwen2",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 48,
        "max_position_embeddings": 64,
    }
    model = ModelConfig(tokenizer_path=str(MULTITURN), init_config=init)
    model_dir, original = prepare_model(model, run_dir=tmp_path, seed=0)
    reloaded = load_tokenizer(model_dir)
    text = "<calc>7+6</calc><result>13</result>13"
    ids = original.encode(text, add_special_tokens=False)
    assert len(ids) == 11  # each tag is one token
    assert reloaded.encode(text, add_special_tokens=False) == ids
    assert reloaded.decode(ids) == text and reloaded.eos_token_id == original.eos_token_id
