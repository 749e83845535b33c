"""The drivers of a run, each a short program over the roles: the RL loop (:mod:`.rl`)
fed synchronously, one step off-policy or fully asynchronously (:mod:`.feeds`), SFT
(:mod:`.sft`), rollout-only (:mod:`.rollout_only`), and the choice among them
(:mod:`.dispatch`)."""
