"""The collectives one piece of code issues, recorded and replayable alone.

A backend's time less the time of exactly its collectives is its local work
(permutations, kernels): ``python -m torchtitan_ext.bench ep`` reports both, and the layout
advisor's measured compute uses the difference.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan_ext.runtime.collectives import ALL_GATHER_SINGLE, all_gather_single


class CollectiveRecorder(TorchDispatchMode):
    """Records the collectives one iteration issues.

    torch.distributed calls are recorded at the Python level (so also inside
    custom ops, where dispatch modes do not reach); functional collectives
    (upstream torchtitan, the nccl backend's count exchange, and the autograd
    backward of functional all-to-alls) through the dispatch mode.
    """

    def __init__(self):
        super().__init__()
        self.calls = []
        self._originals = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            tensor, out_splits, in_splits, group_name = args
            self.calls.append(("a2a", tensor, out_splits, in_splits, _resolve_process_group(group_name)))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        def record(name, kind):
            original = getattr(dist, name)
            self._originals[name] = original

            def recorded(output, tensor, *args, **kwargs):
                if kind == "a2a":
                    out_splits = args[0] if args else kwargs.get("output_split_sizes")
                    in_splits = args[1] if len(args) > 1 else kwargs.get("input_split_sizes")
                    self.calls.append(("a2a", tensor, out_splits, in_splits, kwargs.get("group")))
                else:
                    self.calls.append(("all_gather", tensor, None, None, kwargs.get("group")))
                return original(output, tensor, *args, **kwargs)

            setattr(dist, name, recorded)

        record("all_to_all_single", "a2a")
        record(ALL_GATHER_SINGLE, "all_gather")
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
        return super().__exit__(*exc)

    def replay_plan(self):
        """(the recorded collectives as callables on prepared buffers, bytes this rank sends)."""
        plan, sent = [], 0
        for kind, tensor, out_splits, in_splits, group in self.calls:
            group = group or dist.group.WORLD
            size = dist.get_world_size(group)
            inp = tensor.detach().clone()
            if kind == "all_gather":
                out = inp.new_empty((size * inp.shape[0], *inp.shape[1:]))
                plan.append(partial(all_gather_single, out, inp, group=group))
                sent += inp.numel() * inp.element_size() * size
                continue
            rows = sum(out_splits) if out_splits else inp.shape[0]
            out = inp.new_empty((rows, *inp.shape[1:]))
            plan.append(partial(dist.all_to_all_single, out, inp, out_splits, in_splits, group=group))
            sent += inp.numel() * inp.element_size()
        return plan, sent
