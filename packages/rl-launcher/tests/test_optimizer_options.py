"""optimizer.name / optimizer.momentum / model.dtype / model.gradient_checkpointing: what reaches the backend, and what is
refused at load (before Ray), naming the way out."""

import pytest
from test_train_loop import shrunk

from rl_launcher.config.loader import load_config
from rl_launcher.roles.backends import fsdp_config


def test_sgd_and_its_momentum_reach_rl_fsdp(tmp_path):
    config, _ = load_config(
        shrunk(tmp_path, "--optimizer.name", "sgd", "--optimizer.momentum", "0.9")
    )
    fsdp = fsdp_config(config, model_dir=tmp_path)
    assert (fsdp.optimizer, fsdp.momentum, fsdp.lr) == ("sgd", 0.9, 0.01)


def test_adamw_stays_the_default(tmp_path):
    config, _ = load_config(shrunk(tmp_path))
    assert fsdp_config(config, model_dir=tmp_path).optimizer == "adamw"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--optimizer.name", "sgd", "--backend.name", "megatron"], "backend.name=fsdp"),
        (["--optimizer.momentum", "0.9"], "optimizer.name=sgd"),
        (["--model.dtype", "float16"], "bfloat16"),
    ],
)
def test_what_no_backend_does_is_refused_at_load(tmp_path, extra, named):
    with pytest.raises(ValueError, match=named):
        load_config(shrunk(tmp_path, *extra))
