"""The run's roles, each one object the loops talk to: the training actor group and its
backends, the critic, the reference model, the engines (their servers, the Ray actors that
host them, their health), the rollout manager and its continuous (async) producer, the
reward and the evaluator."""
