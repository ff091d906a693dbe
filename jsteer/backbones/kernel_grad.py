"""A CPU kernel with a kernel backward, differentiable in both modes: :func:`differentiable`.

``jax.custom_vjp`` would give a kernel its backward kernel but no forward mode (``jax.jvp``,
``jacfwd``, ``hessian`` through a backbone are required), and a transpose cannot be attached to a
``custom_vjp`` inside a ``custom_jvp``'s tangent (``custom_vjp_call`` has no transpose rule;
``custom_derivatives.linear_call`` has no jvp for its residuals and no batching rule). So the kernel
is a ``custom_jvp`` whose tangent is the primitive ``jsteer_kernel_tangent``: evaluated (forward
mode), it is the jvp of the rule's hand-written function; transposed (reverse mode), it is the
rule's backward kernel; its own derivatives and its batching are the hand-written function's. The
backward kernel is again a ``custom_jvp`` with the hand-written function's derivatives (a Hessian).

A rule is a hashable value (a frozen dataclass: it is a primitive parameter) with
``hand(res, *primals) -> out`` (the same function in jax.numpy, for every other platform and for
derivatives) and ``backward(res, out, ct, want, *primals)``: the primals' cotangents under ``ct``
by the kernel (None where ``want`` is false), or None for the hand-written function's transpose.
``res`` are non-differentiable arrays (masks, seeds, scales); the kernels run under
``lax.platform_dependent``, so that programs exported for other platforms carry no CPU custom call.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

Array = jax.Array


def on_cpu(kernel: Callable[[], object], hand: Callable[[], object]):
    """kernel() in CPU programs, hand() in programs for every other platform."""
    return jax.lax.platform_dependent(cpu=kernel, default=hand)


def differentiable(rule, kernel: Callable[..., Array], res: Sequence[Array], primals: Sequence[Array]) -> Array:
    """kernel(res, *primals) in CPU programs (``rule.hand(res, *primals)`` elsewhere), with derivatives
    by ``rule``. res and primals are the custom_jvp's arguments, never closed over: under
    ``jax.checkpoint`` the forward is traced again, and a closed-over array of the first trace leaks."""
    n_res = len(res)

    @jax.custom_jvp
    def f(*args):
        res, primals = args[:n_res], args[n_res:]
        return on_cpu(lambda: kernel(res, *primals), lambda: rule.hand(res, *primals))

    def f_jvp(args, tangents):
        res, primals = args[:n_res], args[n_res:]
        out = f(*args)
        return out, _tangent_p.bind(*primals, *res, out, *tangents[n_res:], rule=rule, n_res=n_res)

    f.defjvp(f_jvp)
    return f(*res, *primals)


def backward(rule, res, out: Array, ct: Array, primals: Sequence[Array], kernel: Callable[..., tuple], n: int) -> tuple:
    """The first n primals' cotangents: kernel(res, ct, out, *primals) on CPU, the hand-written vjp
    elsewhere; derivatives of either: the hand-written vjp's (res passed, not closed over, as above)."""
    n_res = len(res)

    def hand_vjp(res, ct, *primals):
        return tuple(jax.vjp(functools.partial(rule.hand, res), *primals)[1](ct)[:n])

    @jax.custom_jvp
    def vjp(ct, out, *args):
        res, primals = args[:n_res], args[n_res:]

        def run():  # in the primals' dtypes, as the hand-written vjp's
            return tuple(g.astype(p.dtype) for g, p in zip(kernel(res, ct, out, *primals), primals))

        return on_cpu(run, lambda: hand_vjp(res, ct, *primals))

    def vjp_jvp(args, tangents):
        ct, _, *rest = args
        t_ct, _, *t_rest = tangents
        res, primals, t_primals = tuple(rest[:n_res]), rest[n_res:], t_rest[n_res:]
        return jax.jvp(functools.partial(hand_vjp, res), (ct, *primals), (t_ct, *t_primals))

    vjp.defjvp(vjp_jvp)
    return vjp(ct, out, *res, *primals)


def _unpack(args, n_res: int) -> tuple:
    """-> primals, res, out, tangents (as many tangents as primals)."""
    n = (len(args) - n_res - 1) // 2
    return args[:n], args[n : n + n_res], args[n + n_res], args[n + n_res + 1 :]


def _tangent_impl(*args, rule, n_res: int) -> Array:
    primals, res, _, tangents = _unpack(args, n_res)
    return jax.jvp(functools.partial(rule.hand, res), tuple(primals), tuple(tangents))[1]


def _tangent_transpose(ct, *args, rule, n_res: int):
    primals, res, out, tangents = _unpack(args, n_res)
    head = [None] * (len(args) - len(tangents))
    want = [ad.is_undefined_primal(x) for x in tangents]
    if type(ct) is ad.Zero or not any(want):
        return head + [None] * len(tangents)
    cts = rule.backward(res, out, ct, want, *primals)
    if cts is None:
        cts = jax.vjp(functools.partial(rule.hand, res), *primals)[1](ct)
    return head + [c if w else None for c, w in zip(cts, want)]


def _tangent_jvp(args, tangents, rule, n_res: int):
    tangents = [ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t in tangents]
    impl = functools.partial(_tangent_impl, rule=rule, n_res=n_res)
    return jax.jvp(impl, tuple(args), tuple(tangents))


def _tangent_batch(args, dims, rule, n_res: int):
    axes = [d if isinstance(d, int) else None for d in dims]  # not_mapped: None
    impl = functools.partial(_tangent_impl, rule=rule, n_res=n_res)
    return jax.vmap(impl, in_axes=axes)(*args), 0


def _abstract_eval(*avals, rule, n_res: int):
    return _unpack(avals, n_res)[2].update(weak_type=False)


_tangent_p = Primitive("jsteer_kernel_tangent")
_tangent_p.def_impl(_tangent_impl)
_tangent_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[_tangent_p] = _tangent_jvp
ad.primitive_transposes[_tangent_p] = _tangent_transpose
batching.primitive_batchers[_tangent_p] = _tangent_batch
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))
