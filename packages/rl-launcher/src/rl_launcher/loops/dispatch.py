"""Which loop drives a run: the choice ``rl-train`` makes from the config. Each driver is
imported only when chosen (``rl-train --help`` and a refused config load none)."""


def run_mode(config):
    """The driver of ``config``: SFT, DPO, rollout-only, or the RL loop (replay included)."""
    if config.mode == "dpo":
        from rl_launcher.loops.dpo import train_dpo

        return train_dpo
    if config.mode == "sft":
        from rl_launcher.loops.sft import train_sft

        return train_sft
    if config.rollout.rollout_only:
        from rl_launcher.loops.rollout_only import rollout_only

        return rollout_only
    from rl_launcher.loops.rl import train

    return train
