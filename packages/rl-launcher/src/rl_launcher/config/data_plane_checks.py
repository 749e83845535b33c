"""``rollout.data_plane: workers`` (:mod:`rl_launcher.roles.rollout_workers`): what it
does not run yet, refused before Ray starts. Kept apart from that module, which imports
torch, so that a config is checked without it."""


def check_data_plane(config) -> None:
    """``rollout.data_plane=workers`` with what it does not run: ValueError naming it."""
    if config.rollout.data_plane == "driver":
        return
    rollout, algorithm, logging = config.rollout, config.algorithm, config.logging
    refused = (
        (f"mode={config.mode}", config.mode != "rl"),
        ("rollout.source=buffer", rollout.source == "buffer"),
        ("rollout.replay_dir", rollout.replay_dir),
        ("rollout.rollout_only", rollout.rollout_only),
        ("rollout.rollout_function", rollout.rollout_function),
        ("rollout.over_sampling > 1", rollout.over_sampling > 1),
        ("rollout.sample_filter", rollout.sample_filter),
        ("rollout.post_process", rollout.post_process),
        ("rollout.dump_dir", rollout.dump_dir),
        ("logging.rollout_log_function", logging.rollout_log_function),
        ("logging.dump_train_batch", logging.dump_train_batch),
        ("algorithm.old_log_probs=rollout", algorithm.old_log_probs == "rollout"),
        ("algorithm.reward_kl_coef > 0", algorithm.reward_kl_coef > 0),
        ("algorithm.advantage_estimator=gae", algorithm.advantage_estimator == "gae"),
        ("distill.coef > 0", config.distill.coef > 0),
    )
    for name, value in refused:
        if value:
            raise ValueError(
                f"rollout.data_plane=workers keeps the samples' tokens on the rollout workers, "
                f"and {name} is not run there yet; unset it, or set rollout.data_plane=driver"
            )
