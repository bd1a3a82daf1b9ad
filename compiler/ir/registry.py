"""Every kiln op's reference implementation as a plain Python function, next to the registered op.

`@kiln_op("kiln::name")` registers the op exactly as torch.library.custom_op does and keeps the undecorated
function. The op itself has no autograd formula (kernels replace it after lowering); calling the plain function
instead runs the same torch code with autograd, which is how kiln.train differentiates a Level-1 graph without
writing a backward for any op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch.library import custom_op

REFERENCE: dict[str, Callable] = {}  # "kiln::name" -> the reference function


def kiln_op(name: str, *, mutates_args: Iterable[str] | str = (), schema: str | None = None
            ) -> Callable[[Callable], object]:
    def register(fn: Callable) -> object:
        assert name not in REFERENCE, f"{name} is registered twice"
        REFERENCE[name] = fn
        return custom_op(name, mutates_args=mutates_args, schema=schema)(fn)

    return register
