"""The backend seam in rl-core: the protocol checker and the shared process-group setup."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from rl_core.distributed import free_port
from rl_core.protocols import TrainingBackend, protocol_mismatches


class Conforming:
    step: int = 0

    @classmethod
    def start(cls, config, *, rank, world_size, master_addr, master_port, timeout_s=60.0): ...

    @property
    def data_rank(self) -> int:
        return 0

    def compute_log_probs(self, batch, *, model="actor"): ...
    def train_step(self, batch): ...
    def export_weights(self, *, bucket_bytes): ...
    def export_hf(self, path, *, bucket_bytes=1, dtype=None): ...
    def save_checkpoint(self, path): ...
    def load_checkpoint(self, path): ...
    def update_reference(self): ...
    def offload(self): ...
    def onload(self): ...


def test_a_conforming_class_has_no_mismatches():
    assert protocol_mismatches(Conforming, TrainingBackend) == []
    assert isinstance(Conforming(), TrainingBackend)


def test_mismatches_name_the_member_and_the_problem():
    def compute_log_probs(self, batch, model="actor"): ...  # model no longer keyword-only
    def export_hf(self, path, *, bucket_bytes, dtype): ...  # defaults dropped
    def train_step(self, batch, *, scale): ...  # a new required parameter

    members = {k: v for k, v in vars(Conforming).items() if k != "data_rank"}
    changed = {
        "compute_log_probs": compute_log_probs,
        "export_hf": export_hf,
        "train_step": train_step,
    }
    Drifted = type("Drifted", (), members | changed)
    problems = protocol_mismatches(Drifted, TrainingBackend)
    assert problems[0].startswith("Drifted.compute_log_probs(self, batch, model='actor'): expected")
    assert "Drifted.export_hf: parameter 'bucket_bytes' needs a default" in problems
    assert "Drifted.export_hf: extra parameter 'dtype' needs a default" in problems
    assert "Drifted.train_step: extra parameter 'scale' needs a default" in problems
    assert "Drifted.data_rank is missing" in problems
    assert len(problems) == 5


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_init_distributed_from_arguments_and_from_the_environment(tmp_path: Path):
    """Two gloo ranks in fresh processes: one given everything, one reading env vars."""
    script = textwrap.dedent("""
        import os, sys
        import torch, torch.distributed as dist
        from rl_core.distributed import init_distributed
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        if rank == 0:
            info = init_distributed(device="cpu", rank=0, world_size=2,
                                    master_addr="127.0.0.1", master_port=port)
        else:
            os.environ.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            info = init_distributed(device="cpu")
        total = torch.tensor([info.rank + 1.0])
        dist.all_reduce(total)
        print(info.rank, info.world_size, info.device, float(total))
        dist.destroy_process_group()
    """)
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), str(port)], stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=120)[0].split() for process in ranks]
    assert outputs == [["0", "2", "cpu", "3.0"], ["1", "2", "cpu", "3.0"]]
