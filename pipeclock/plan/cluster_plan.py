"""One cluster configuration judged: memory per GPU, step time, and the rates people compare.

- tokens/s per GPU: the step's tokens (``global_batch x seq_len``) over the step time, over the GPUs;
- TFLOP/s per GPU: tokens/s per GPU times the model FLOPs per token (`PaperModel.model_flops_per_token`:
  6 x the matrix parameters a token uses plus attention's 12 x layers x q_dim x seq_len; recompute not
  counted), as Megatron-LM's and torchtitan's tables count them;
- MFU: that over the dense peak of the dtype the products run in (bf16's for bf16, fp8's for fp8).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import GpuMemory, gpu_memory
from pipeclock.plan.cluster_time import StepTime, step_time
from pipeclock.plan.gpus import Cluster
from pipeclock.plan.paper_model import PaperModel


@dataclass(frozen=True)
class Prediction:
    config: Config
    memory: GpuMemory
    time: StepTime
    tokens_per_second_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    capacity: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    def as_json(self) -> dict:
        """The fields ``plan --json`` prints for one configuration."""
        c, t = self.config, self.time
        return {
            "tp": c.tp,
            "pp": c.pp,
            "dp": c.dp,
            "ep": c.ep,
            "cp": c.cp,
            "schedule": c.schedule,
            "chunks": c.chunks,
            "microbatch_size": c.microbatch_size,
            "microbatches": c.microbatches,
            "recompute": c.recompute,
            "zero": c.zero,
            "sequence_parallel": c.sequence_parallel,
            "ends": c.ends,
            "tokens_per_second_per_gpu": round(self.tokens_per_second_per_gpu, 3),
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "mfu": round(self.mfu, 4),
            "memory_per_gpu_bytes": round(self.memory.total),
            "memory_parts_bytes": {name: round(value) for name, value in self.memory.parts.items()},
            "fits": self.fits,
            "step_seconds": round(t.step, 6),
            "bubble": round(t.bubble, 4),
            "seconds": {
                "pipeline": round(t.pipeline, 6),
                "compute": round(t.compute, 6),
                "recompute": round(t.recompute, 6),
                "tp_collectives": round(t.tp, 6),
                "dp_exposed": round(t.dp, 6),
                "optimizer": round(t.optimizer, 6),
                "ep_all_to_all": round(t.ep, 6),
            },
        }


def predict(model: PaperModel, config: Config, job: Job, software: Software, cluster: Cluster) -> Prediction:
    """``config``'s memory and speed on ``cluster`` (see the module's rates)."""
    memory = gpu_memory(model, config, job, software)
    return rate(model, config, job, software, cluster, memory, step_time(model, config, job, software,
                                                                         cluster.kind))  # fmt: skip


def rate(model, config, job, software, cluster: Cluster, memory: GpuMemory, time: StepTime) -> Prediction:
    tokens = job.global_batch * job.seq_len / time.step / cluster.count
    flops = tokens * model.model_flops_per_token(job.seq_len)
    peak = cluster.kind.peak(software.dtype)
    return Prediction(config, memory, time, tokens, flops / 1e12, flops / peak, cluster.kind.memory)
