"""A training run: model preparation, the training actor group, the rollout manager,
checkpoints and the loops that drive them (:func:`rl_launcher.run.loop.train`)."""
