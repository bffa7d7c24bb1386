"""A norm with a weight per head, split with its heads: the ``per_head`` style (pipeclock's own).

Cohere's ``use_qk_norm`` normalises each head of the queries and keys with a weight of its own,
``[heads, head_dim]``. Between the column split of ``q_proj`` and the row split of ``o_proj`` a rank holds
``heads / tp`` of the heads, so it keeps the same rows of that weight (``Shard(0)``) and runs the norm on
its heads alone: its input is taken as ``Shard`` on the heads dim (the second to last), the norm's own
code runs on DTensors, and the output is handed on as this rank's slice again. The weight's gradient is
each rank's rows, whole: nothing to sum.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class PerHead(ParallelStyle):
    """Each of the module's 2-d weights split by rows (heads); its input and output the rank's heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _rows, input_fn=_heads_in, output_fn=_heads_out)


def _rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, parameter in list(module.named_parameters(recurse=False)):
        placement = Shard(0) if parameter.dim() == 2 else None
        if placement is not None:
            module.register_parameter(key, nn.Parameter(distribute_tensor(parameter, mesh, [placement])))


def _heads_in(module: nn.Module, args, mesh: DeviceMesh):
    x = args[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
    return (x, *args[1:])


def _heads_out(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output
