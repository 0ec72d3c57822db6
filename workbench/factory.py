"""The trust rules of `model.factory`: a spec that names a factory is code.

Like transformers' `trust_remote_code`, naming a callable in a spec runs it, so:
- planning (validate, memory, plan, the notebook's memory chart) never imports or calls a factory
  unless the caller opts in (`--trust-factory`, `--set model.trust_factory=true`, or the field in a
  spec built in Python; a spec file cannot trust itself); it plans from `model.params` or refuses;
- running imports a factory only from the user's own project or an installed package, never from
  the standard library, builtins, workbench itself or an installed tool that runs commands (pip,
  setuptools, pexpect, torch.hub, ...), never through a private name, and only a function or class
  defined there (not a re-export such as `from os import system`).
The origin checks need no import of the factory's module (torch-free, docs/architecture.md); torch
is imported only by the functions that call a factory, which planning reaches only when trusted.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
from typing import TYPE_CHECKING

from workbench.errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn

OPT_IN = "--trust-factory (or --set model.trust_factory=true, or model.trust_factory=True in a spec built in Python)"
_OWN = {"workbench", "backends"}  # ours: no model factories, and their functions act (run, dispatch, write)
# Installed tools whose public functions run commands or other code (a vendored distutils spawn, a
# pty, torch.hub's hubconf.py, launchers, shells, debuggers): never a model factory.
_TOOLS = ("pip", "setuptools", "pkg_resources", "distutils", "_distutils_hack", "pexpect", "ptyprocess", "sh",
          "plumbum", "invoke", "fabric", "paramiko", "IPython", "ipykernel", "jupyter_client", "debugpy", "pdbpp",
          "torch.hub", "torch.utils.cpp_extension", "torch.distributed.run", "torch.distributed.launch",
          "torch.distributed.elastic", "torch.package", "torch.utils.hipify", "ray", "deepspeed.launcher",
          "accelerate.commands", "transformers.dynamic_module_utils")


def _in_stdlib(origin: str) -> bool:
    """A file of the standard library: under its folders and outside every site-packages (a
    virtualenv's platstdlib is the folder that holds its site-packages)."""
    import site

    def under(dirs) -> bool:
        return any(origin.startswith(os.path.realpath(d) + os.sep) for d in dirs)

    paths = sysconfig.get_paths()
    sites = [paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages()]
    return under([paths["stdlib"], paths["platstdlib"]]) and not under(sites)


def _is_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__"


def check_origin(path: str) -> tuple[str, str]:
    """(module, attribute) of a factory path whose top-level module may provide a factory, checked
    without running any module code.

    Raises:
        ConfigError: not 'pkg.module:function', or a standard-library, builtin or workbench module.
    """
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr or not all(p.isidentifier() for p in [*module.split("."), *attr.split(".")]):
        raise ConfigError(f"model.factory {path!r}: expected 'pkg.module:function' naming a function or class of "
                          "your project (or of an installed package) that returns a torch.nn.Module.")
    top = module.split(".")[0]
    private = [p for p in [*module.split("."), *attr.split(".")] if p.startswith("_")]
    if private:
        raise ConfigError(f"model.factory {path!r} names private parts ({', '.join(private)}): a factory is a public "
                          "function or class of your project or of an installed package.")
    tool = next((t for t in _TOOLS if module == t or module.startswith(t + ".")), None)
    if _is_stdlib(module) or top in _OWN or tool:
        where = ("workbench's own packages" if top in _OWN else f"{tool}, a tool that runs commands or code" if tool
                 else "the Python standard library or builtins")
        raise ConfigError(f"model.factory {path!r} names {where}, which build no models: a factory runs only from "
                          "your project or an installed package. Point it at a function that returns your "
                          "torch.nn.Module, e.g. model: {factory: 'my_models:build', vocab: 256, seq_len: 64}.")
    try:
        found = importlib.util.find_spec(top)  # a top-level name is found without running any module code
    except (ImportError, ValueError):
        found = None
    # Not found here (e.g. a project module the job's machines will have): importing it later says so.
    origin = os.path.realpath(found.origin) if found and found.origin and found.has_location else None
    if origin and _in_stdlib(origin):
        raise ConfigError(f"model.factory {path!r}: {top!r} resolves to the standard library ({origin}); a factory "
                          "runs only from your project or an installed package. Rename the module.")
    return module, attr


def resolve(path: str):
    """Import the factory's module and return the callable, after `check_origin`.

    Raises:
        ConfigError: refused by `check_origin`, not importable, or not a function or class
            defined in a module of the project or an installed package.
    """
    module_name, attr = check_origin(path)
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.factory {path!r}: cannot import it ({e}). Is the module on PYTHONPATH?") from None
    defined_in = getattr(obj, "__module__", None) or ""
    tool = any(defined_in == t or defined_in.startswith(t + ".") for t in _TOOLS)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)) or _is_stdlib(defined_in) \
            or defined_in.split(".")[0] in _OWN or tool:
        raise ConfigError(f"model.factory {path!r} is a {type(obj).__name__} from {defined_in or 'an unknown module'!r}, "
                          "not a function or class of your project or an installed package: a factory must be "
                          "defined there (a re-export of a standard-library callable is refused).")
    return obj


def planning_refusal(path: str) -> ConfigError:
    """The error of a planning command that would have to run a factory the user did not trust."""
    return ConfigError(f"model.factory {path!r} is code: counting its parameters means importing and calling it, "
                       f"which planning does only when you opt in. Give the model's size instead (model.params: N, "
                       f"e.g. 1.3e9), or, if you trust this spec, set {OPT_IN}.")


def call_factory(path: str, kwargs: dict) -> nn.Module:
    """Call a model factory under the trust rules above and check what it returns."""
    import torch.nn as nn

    fn = resolve(path)
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model.factory {path!r} does not take model.kwargs {sorted(kwargs)}: {e}.") from None
    except ValueError:
        pass  # no signature to check (some classes defined in C)
    model = fn(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory {path!r} returned {type(model).__name__}, not a torch.nn.Module. A factory "
                          "returns the model (forward(tokens) -> logits), built from model.kwargs.")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"model.factory {path!r} returned a {type(model).__name__} without parameters: nothing "
                          "would train. Return the model whose forward(tokens) gives logits.")
    return model


def build_factory_meta(path: str, kwargs: dict) -> nn.Module:
    """The factory's model with its parameters on the meta device (no memory): what the runtime
    parallelizes, and what planning counts for a trusted factory."""
    import torch

    with torch.device("meta"):
        return call_factory(path, kwargs)
