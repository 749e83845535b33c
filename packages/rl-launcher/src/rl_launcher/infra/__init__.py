"""What the roles and loops stand on: placement plans and the Ray cluster, rendezvous,
colocation turns and weight transports, shared directories, process lifetime; the run
directory, its lock, metrics log and sinks; checkpoints, the resume choice, the data order
and rollout dumps; fault rules, stop signals, garbage-collection pauses, GPU sampling."""
