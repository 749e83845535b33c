"""rl_core.names: the algorithms' names without torch, each registry's built-ins declared
there exactly as their home module registers them, and loaded on first use."""

import subprocess
import sys

import pytest

from rl_core import names
from rl_core.registry import Registry

REGISTRIES = {
    "rl_core.advantages": names.ADVANTAGE_ESTIMATORS,
    "rl_core.losses": names.POLICY_LOSSES,
}


def run_fresh(script: str) -> str:
    """``script``'s output in a new interpreter (nothing of rl-core imported yet)."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_names_and_their_checks_import_no_torch():
    out = run_fresh(
        "import sys\n"
        "from rl_core import names\n"
        "listed = [names.ADVANTAGE_ESTIMATORS.names(), names.POLICY_LOSSES.names()]\n"
        "assert 'grpo' in names.ADVANTAGE_ESTIMATORS and 'cispo' in names.POLICY_LOSSES\n"
        "assert names.load_reducer('token-mean') == 'token-mean'\n"
        "try:\n"
        "    names.POLICY_LOSSES.get('ppo2')\n"
        "except ValueError as error:\n"
        "    print(error)\n"
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))\n"
    )
    refusal, loaded = out.splitlines()
    assert refusal == (
        "unknown policy loss 'ppo2'; choose one of: cispo, gspo, ppo "
        "or a dotted path 'pkg.module:function'"
    )
    assert loaded == "[]"


@pytest.mark.parametrize("home", sorted(REGISTRIES))
def test_declared_built_ins_are_what_the_home_module_registers(home):
    out = run_fresh(
        "import importlib\n"
        "from rl_core import names\n"
        f"registry = {{r.home: r for r in vars(names).values() if hasattr(r, 'home')}}[{home!r}]\n"
        "declared = registry.names()\n"
        f"importlib.import_module({home!r})\n"
        "print(declared == sorted(registry._entries), declared == registry.names())\n"
    )
    assert out == "True True"


def test_first_get_of_a_built_in_imports_its_home():
    out = run_fresh(
        "import sys\n"
        "from rl_core.names import POLICY_LOSSES\n"
        "before = 'rl_core.losses' in sys.modules\n"
        "loss = POLICY_LOSSES.get('gspo')\n"
        "print(before, loss.__module__, 'rl_core.losses' in sys.modules)\n"
    )
    assert out == "False rl_core.losses True"


def test_the_implementing_modules_re_export_the_same_registries():
    from rl_core import advantages, aggregation, importance, kl, losses, preference

    assert advantages.ADVANTAGE_ESTIMATORS is names.ADVANTAGE_ESTIMATORS
    assert losses.POLICY_LOSSES is names.POLICY_LOSSES
    assert aggregation.AGGREGATION_MODES is losses.AGGREGATION_MODES is names.AGGREGATION_MODES
    assert aggregation.load_reducer is names.load_reducer
    assert kl.KL_KINDS is names.KL_KINDS and preference.PREFERENCE_LOSSES is names.PREFERENCE_LOSSES
    assert (importance.IS_LEVELS, importance.IS_MODES) == (names.IS_LEVELS, names.IS_MODES)


def test_a_built_in_name_is_taken_before_its_home_is_imported():
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        names.ADVANTAGE_ESTIMATORS.register("grpo")(lambda inputs: None)


def test_a_home_that_misses_a_declared_name_is_caught(tmp_path, monkeypatch):
    (tmp_path / "half_home.py").write_text(
        "from rl_core.registry import Registry\n"
        "THINGS = Registry('thing', home=__name__, builtins=('a', 'b'))\n"
        "THINGS.register('a')(len)\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    import half_home

    assert half_home.THINGS.names() == ["a", "b"] and len(half_home.THINGS) == 2
    assert half_home.THINGS.get("a") is len
    with pytest.raises(AssertionError, match=r"half_home registers no thing \['b'\]"):
        half_home.THINGS.get("b")


def test_built_in_names_need_a_home():
    with pytest.raises(AssertionError):
        Registry("thing", builtins=("a",))
