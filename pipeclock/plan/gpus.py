"""The GPU kinds a cluster plan knows, and how a cluster is written: ``512xH100-80GB``, ``4xRTX4090``.

Every figure of the table is a vendor datasheet's (sources in docs/cluster.md): peak *dense* tensor-core
TFLOP/s (never the 2:4-sparse figure) in bf16 and fp8, plain fp32, memory and its bandwidth, and the
links: inside a node (per GPU, one direction) and between nodes (the network per GPU). Two figures are
not on any datasheet and say so: GPUs per node for cards sold one by one (the RTX 4090 and the L40S,
taken as a server of 8 on PCIe), and the network of such a server. ``--gpu-spec FILE`` gives any other
kind in the same fields, as JSON.

Memory is the datasheet's GB read as GiB: HBM and GDDR chips come in binary sizes, and the figure a GPU
reports (``torch.cuda.mem_get_info``) is within 1 % of it.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeclock.plan.calibration import (
    A100_GEMM_EFFICIENCY,
    GEMM_EFFICIENCY,
    H100_FP8_GEMM_EFFICIENCY,
    H100_GEMM_EFFICIENCY,
)

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class GpuKind:
    """One GPU kind's datasheet, in SI units: FLOP/s, bytes, bytes per second."""

    name: str
    bf16_flops: float  # dense tensor-core peak
    fp32_flops: float  # plain fp32 (no TF32)
    fp8_flops: float | None  # dense; None where the card has no fp8 tensor cores
    memory: int  # bytes
    memory_bandwidth: float  # bytes/s
    gpus_per_node: int
    intra_node_link: str  # "NVLink", "PCIe", "Infinity Fabric"
    intra_node_bandwidth: float  # bytes/s per GPU, one direction
    inter_node_bandwidth: float  # bytes/s per GPU, one direction
    gemm_efficiency: float = GEMM_EFFICIENCY  # share of the peak large products reach: calibration
    fp8_gemm_efficiency: float | None = None  # the same of the fp8 peak; None: gemm_efficiency x FP8_SHARE

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s of the matrix units in ``dtype`` (fp32: the plain fp32 figure)."""
        if dtype == "fp8":
            if self.fp8_flops is None:
                raise ValueError(f"{self.name} has no fp8 tensor cores: use --dtype bf16")
            return self.fp8_flops
        return self.bf16_flops if dtype == "bf16" else self.fp32_flops


def _kind(
    name, bf16, fp32, fp8, memory_gb, bandwidth_gb, per_node, link, intra_gb, inter_gbit,
    efficiency=GEMM_EFFICIENCY, fp8_efficiency=None,
) -> GpuKind:  # fmt: skip
    """A row of the table in the datasheets' units: TFLOP/s, GB, GB/s, and the network in Gb/s."""
    return GpuKind(
        name, bf16 * 1e12, fp32 * 1e12, None if fp8 is None else fp8 * 1e12, round(memory_gb * GIB),
        bandwidth_gb * GB, per_node, link, intra_gb * GB, inter_gbit * GB / 8, efficiency, fp8_efficiency,
    )  # fmt: skip


_H100 = _kind(
    "H100-80GB", 989.4, 66.9, 1978.9, 80, 3350, 8, "NVLink", 450, 400,
    H100_GEMM_EFFICIENCY, H100_FP8_GEMM_EFFICIENCY,
)  # fmt: skip
KINDS: dict[str, GpuKind] = {
    kind.name: kind
    for kind in (
        _kind("A100-40GB", 312, 19.5, None, 40, 1555, 8, "NVLink", 300, 200, A100_GEMM_EFFICIENCY),
        _kind("A100-80GB", 312, 19.5, None, 80, 2039, 8, "NVLink", 300, 200, A100_GEMM_EFFICIENCY),
        _H100,
        _kind("H200", 989.4, 66.9, 1978.9, 141, 4800, 8, "NVLink", 450, 400),
        _kind("RTX4090", 165.2, 82.6, 330.3, 24, 1008, 8, "PCIe", 32, 100),
        _kind("L40S", 362.05, 91.6, 733, 48, 864, 8, "PCIe", 32, 200),
        _kind("MI300X", 1307.4, 163.4, 2614.9, 192, 5300, 8, "Infinity Fabric", 448, 400),
    )
}

SPEC_FIELDS = {
    "name": str,
    "bf16_tflops": float,
    "fp32_tflops": float,
    "memory_gb": float,
    "memory_bandwidth_gb_s": float,
    "gpus_per_node": int,
    "intra_node_link": str,
    "intra_node_gb_s": float,
    "inter_node_gbit_s": float,
}
OPTIONAL_SPEC_FIELDS = {"fp8_tflops": float, "gemm_efficiency": float, "fp8_gemm_efficiency": float}


@dataclass(frozen=True)
class Cluster:
    """``count`` GPUs of one kind."""

    count: int
    kind: GpuKind

    @property
    def nodes(self) -> int:
        return -(-self.count // self.kind.gpus_per_node)

    def __str__(self) -> str:
        return f"{self.count}x{self.kind.name}"


def parse_cluster(text: str, spec: GpuKind | None = None) -> Cluster:
    """``"512xH100-80GB"`` (also ``×``, any case) as a `Cluster`; ``spec`` answers for its own name."""
    match = re.fullmatch(r"\s*(\d+)\s*[x×]\s*(\S+)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--cluster takes N x KIND, like 512xH100-80GB or 4xRTX4090, got {text!r}")
    if int(match.group(1)) < 1:
        raise ValueError(f"--cluster needs at least one GPU, got {text!r}")
    count, name = int(match.group(1)), match.group(2)
    known = dict(KINDS) | ({spec.name: spec} if spec else {})
    by_upper = {key.upper(): kind for key, kind in known.items()}
    if name.upper() not in by_upper:
        raise ValueError(
            f"unknown GPU kind {name!r}: known kinds are {', '.join(known)} (or describe one with "
            "--gpu-spec FILE)"
        )
    return Cluster(count, by_upper[name.upper()])


def load_spec(path: str | Path) -> GpuKind:
    """A GPU kind from a JSON file with the fields of `SPEC_FIELDS` (units in their names)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--gpu-spec {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--gpu-spec {path} is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--gpu-spec {path} must hold one JSON object")
    known = SPEC_FIELDS | OPTIONAL_SPEC_FIELDS
    unknown = [field for field in data if field not in known]
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {near[0]}?)" if near else f"; the fields are {', '.join(known)}"
        raise ValueError(f"--gpu-spec {path}: unknown field {unknown[0]}{hint}")
    missing = [field for field in SPEC_FIELDS if field not in data]
    if missing:
        raise ValueError(
            f"--gpu-spec {path} lacks {', '.join(missing)} (it needs {', '.join(SPEC_FIELDS)}; "
            f"optional: {', '.join(OPTIONAL_SPEC_FIELDS)})"
        )
    values = {}
    for field, kind in (SPEC_FIELDS | OPTIONAL_SPEC_FIELDS).items():
        if field in data:
            values[field] = _field(data[field], field, kind, path)
    return _kind(
        values["name"], values["bf16_tflops"], values["fp32_tflops"], values.get("fp8_tflops"),
        values["memory_gb"], values["memory_bandwidth_gb_s"], values["gpus_per_node"],
        values["intra_node_link"], values["intra_node_gb_s"], values["inter_node_gbit_s"],
        values.get("gemm_efficiency", GEMM_EFFICIENCY), values.get("fp8_gemm_efficiency"),
    )  # fmt: skip


MOST = 1e15  # above any real GPU's figure in these units; NaN, infinity (JSON's 1e400) and overflow excluded


def _field(value, field: str, kind: type, path) -> str | float | int:
    if kind is str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"--gpu-spec {path}: {field} must be a non-empty string, got {value!r}")
        return value.strip()
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < MOST:
        raise ValueError(f"--gpu-spec {path}: {field} must be a finite number above 0, got {value!r}")
    if kind is int and value != int(value):
        raise ValueError(f"--gpu-spec {path}: {field} must be a whole number, got {value!r}")
    return kind(value)
