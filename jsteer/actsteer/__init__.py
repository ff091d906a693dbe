"""jsteer.actsteer: activation steering (ActAdd, CAA, repeng-style PCA control vectors).

    cv = jsteer.actsteer.train(lm, positive, negative, layers=[10, 12], method="caa")
    lm.generate(prompts, hooks=cv.hooks(4.0))          # strength traced: no recompiles
    jsteer.compose(cv.hooks(4.0), other_hooks)         # e.g. with an LM-Steer steer
    cv.save("cv.safetensors"); ControlVector.load("cv.safetensors", lm=lm)
    cv.export_gguf("cv.gguf"); ControlVector.from_gguf("cv.gguf", lm=lm)   # llama.cpp / repeng

Directions are read from and added to ``resid_post.<layer>`` (the residual stream after 0-based
layer ``layer``) through :mod:`jsteer.interventions`: no backbone changes. Modules: extract
(the methods), vector (:class:`ControlVector`, the safetensors file), llamacpp (GGUF), cli.
"""

from jsteer.actsteer.extract import METHODS, REDUCE, activations, direction, train  # noqa: F401
from jsteer.actsteer.vector import ControlVector, WrongModelError  # noqa: F401

__all__ = ["train", "ControlVector", "WrongModelError", "METHODS", "REDUCE", "activations", "direction"]
