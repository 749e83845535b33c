"""Ray's `uv run` runtime-env hook is switched off for a local Ray before ray is imported."""

import os

from rl_launcher.infra.ray_cluster import LOCAL_RAY_ENV, prepare_local_ray_env


def test_local_ray_env_is_set_only_without_a_cluster(monkeypatch):
    for name in LOCAL_RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    prepare_local_ray_env("ray://head:10001")
    assert all(name not in os.environ for name in LOCAL_RAY_ENV)
    prepare_local_ray_env(None)
    assert all(os.environ[k] == v for k, v in LOCAL_RAY_ENV.items())


def test_user_setting_wins(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "1")
    prepare_local_ray_env(None)
    assert os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "1"
