"""DebugGraphModule: a torch.fx.GraphModule that names the node where a run failed.

It differs from a GraphModule in four ways only:

* an exception raised while running the generated ``forward`` gets a note
  (PEP 678, printed under the traceback) naming the node key, what the node
  does, the user's source line and the shapes of its inputs;
* pickling (``torch.save``) keeps fxdebug's node meta (keys, source lines),
  which torch otherwise drops because it re-traces the code on load;
* the generated ``forward`` has a real, stable filename derived from a hash of
  its code (``/fxdebug-generated/ResNet_1f0c2a9b7d3e.py``), registered with
  ``linecache``: tracebacks keep their frames and show the generated line, and
  ``pdb`` can ``break`` in it (torch's ``<eval_with_key>.N`` names change with a
  global counter and make torch drop the traceback of errors raised there);
* ``defer_recompile()`` generates and compiles the code on first use (a call,
  ``gm.code``, pickling), as torch.fx's lazy recompile does: compiling the
  code of a 10k-node graph takes longer than tracing it.
"""

from __future__ import annotations

import bdb
import contextlib
import copy
import hashlib
import linecache
import os
import threading
import types
import weakref

import torch
import torch.fx as fx
from .. import runtime
from ..runtime import torch_compat
from .keys import META_KEY, META_SOURCE, assign_missing_keys, op_name
from ..runtime.formatting import format_location, value_text

__all__ = ["DebugGraphModule", "keyed_copy", "lazy_graph_module", "MODES_META"]

# gm.meta key of the ModeFollower that makes gm follow train()/eval() (modes.py); a copy
# made by keyed_copy is a graph of its own and does not take it
MODES_META = "fxdebug_modes"

_NOTE_MARK = "fxdebug: "
_REALIZE_LOCK = threading.RLock()

# Not a folder on disk: the source lives in linecache (see generated_filename).
GENERATED_DIR = os.path.join(os.sep, "fxdebug-generated")


def generated_filename(class_name: str, code: str) -> str:
    r"""The stable filename of a generated ``forward``: class name plus a hash of the code.

    >>> generated_filename("ResNet", "def forward(self, x):\n    return x\n")
    '/fxdebug-generated/ResNet_43ee807b0894.py'
    """
    digest = hashlib.sha1(code.encode()).hexdigest()[:12]
    stem = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in class_name) or "GraphModule"
    return os.path.join(GENERATED_DIR, f"{stem}_{digest}.py")


def _register_source(filename: str, code: str) -> None:
    """Put ``code`` into linecache under ``filename`` (mtime None: checkcache keeps it)."""
    lines = code.splitlines(keepends=True)
    linecache.cache[filename] = (len(code), None, lines, filename)


def _own_call(cls: type) -> None:
    """Give ``cls`` (torch makes one class per GraphModule) its own copy of
    ``DebugGraphModule.__call__``, with a code object of its own.

    ``torch.compile(gm)`` compiles ``__call__``, guarding on ``type(gm)``, and dynamo
    recompiles one code object at most ``recompile_limit`` (8) times: with one shared
    ``__call__``, the ninth instrumented module compiled in a process would fail under
    ``fullgraph=True``. With its own code, each module counts alone, as a plain fx
    GraphModule's ``forward`` does.
    """
    if "__call__" in cls.__dict__:
        return
    shared = DebugGraphModule.__call__
    own = types.FunctionType(shared.__code__.replace(), shared.__globals__, shared.__name__,
                             shared.__defaults__, shared.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = (shared.__kwdefaults__,
                                                         shared.__qualname__, shared.__doc__)
    cls.__call__ = own  # type: ignore[method-assign]


@torch.compiler.disable
def _follow_eagerly(follower, gm: fx.GraphModule) -> None:
    """A mode switch seen while torch.compile traces ``gm``: the graph is swapped outside the
    compiled code (one graph break, on the call after a switch only)."""
    follower.follow(gm)


class DebugGraphModule(fx.GraphModule):
    """A GraphModule returned by fxdebug; use it exactly like one.

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)))
        >>> try:
        ...     gm(torch.randn(1, 3))
        ... except RuntimeError as error:
        ...     print(error.__notes__[0].split(" (")[0])
        fxdebug: failed at node '0'
    """

    # keyed_copy(..., recompile=False) builds a module whose caller recompiles it once,
    # after its passes: GraphModule.__init__'s own recompile is deferred then.
    _defer_recompile = False

    def recompile(self):
        if type(self)._defer_recompile:
            self.defer_recompile()
            return None
        self.__dict__["_fxdebug_compiling"] = True  # self._code below must not realize again
        try:
            python_code = super().recompile()
            cls = type(self)  # torch makes one class per instance, named after the model
            filename = generated_filename(cls.__name__, self._code)
            _register_source(filename, self._code)
            cls.forward = _compile_forward(self._code, python_code.globals, filename)
            _look_up_children_fast(cls, self)
            _own_call(cls)
        finally:
            self.__dict__.pop("_fxdebug_compiling", None)
        self.__dict__.pop("_fxdebug_pending", None)  # only now: other threads wait until here
        return python_code

    def defer_recompile(self) -> None:
        """Generate the code on first use: a call, ``gm.code``, ``print(gm)``, pickling.

        >>> import torch, fxdebug
        >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.ReLU()))
        >>> gm.defer_recompile()
        >>> gm.code.lstrip().startswith("def forward"), gm(torch.tensor([-1.0])).tolist()
        (True, [0.0])
        """
        self.__dict__["_fxdebug_pending"] = True
        setattr(type(self), "forward", _PendingForward(self))  # a callable standing in for it
        _own_call(type(self))
        specs = torch_compat.pytree_specs(self._graph)
        if specs is not None:  # what torch's recompile sets besides the code
            self._in_spec, self._out_spec = specs

    def _realize(self) -> None:
        if self.__dict__.get("_fxdebug_pending"):
            with _REALIZE_LOCK:  # two threads' first calls: one compiles, the other waits
                if self.__dict__.get("_fxdebug_pending") and \
                        not self.__dict__.get("_fxdebug_compiling"):
                    self.recompile()

    @property
    def _code(self) -> str:  # torch reads self._code for gm.code, print(gm), to_folder
        self._realize()
        try:
            return self.__dict__[torch_compat.CODE_ATTR]
        except KeyError:
            raise AttributeError(torch_compat.CODE_ATTR) from None

    @_code.setter
    def _code(self, value: str) -> None:
        self.__dict__[torch_compat.CODE_ATTR] = value

    def _follow_mode(self) -> None:
        follower = self.__dict__.get("meta", {}).get(MODES_META)
        if follower is None:
            return
        if torch.compiler.is_compiling():
            # torch.compile(gm) traces this call: reading the flags is all it sees (it guards
            # on them); only a switch since the last call leaves the graph, to swap it eagerly
            if not follower.in_step():
                _follow_eagerly(follower, self)
            return
        follower.follow(self)  # the graph of the modes the model is in now (modes.py)

    def train(self, mode: bool = True):
        self._follow_mode()  # flags as they were, then the switch, then its graph
        super().train(mode)
        self._follow_mode()
        return self

    def use_graph(self, graph: fx.Graph) -> None:
        """Run ``graph`` from now on (code generated on first use), as ``gm.graph = graph``
        does without compiling now."""
        cls = type(self)  # this module's own class: its recompile defers
        cls._defer_recompile = True
        try:
            self.graph = graph
        finally:
            del cls._defer_recompile

    def __call__(self, *args, **kwargs):
        self._follow_mode()
        self._realize()
        filename = type(self).forward.__code__.co_filename
        if filename not in linecache.cache:  # linecache.clearcache() was called
            _register_source(filename, self._code)
        grad_mode = torch.is_grad_enabled()
        regions = self.meta.get(runtime.REGIONS_ATTR)  # captures inside leaf modules
        try:
            with regions.installed(self) if regions is not None else contextlib.nullcontext():
                return super().__call__(*args, **kwargs)
        except bdb.BdbQuit:  # the user quit pdb at a breakpoint: not a failure of the model
            torch.set_grad_enabled(grad_mode)
            raise
        except Exception as exc:
            torch.set_grad_enabled(grad_mode)  # a grad-mode node's block may not have ended
            _annotate(self, exc, args, kwargs)
            raise

    def __reduce__(self):
        self._realize()  # torch copies __dict__ (with the code) before it recompiles
        rebuild, rebuild_args = super().__reduce__()
        meta = tuple((node.name, node.op, _target_id(node.target),
                      {k: v for k, v in node.meta.items() if k.startswith("fxdebug_")})
                     for node in self.graph.nodes)
        return (_rebuild, (rebuild, rebuild_args, meta, dict(self.meta)))


def _compile_forward(code: str, globals_: dict, filename: str):
    """The ``forward`` function of generated ``code``, compiled under ``filename``."""
    namespace = dict(globals_)
    exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - torch.fx's own generated code
    return namespace["forward"]


_CHILDREN = torch_compat.CHILDREN_ATTR


_MODULE_GETATTR = torch.nn.Module.__getattr__


class _Child:
    """``gm.<name>`` for a child module of ``gm``, read from where nn.Module registers it.

    The generated ``forward`` reads each child it calls (``getattr(self, "0")``,
    ``self.layer1``); nn.Module finds children only in ``__getattr__``, after a failed
    lookup that costs about 0.6 µs, as much as a small op. A non-data descriptor on the
    module's own class (torch.fx gives every GraphModule one) is consulted before
    ``__getattr__`` and after the instance's ``__dict__``, so nothing it answers differs:
    a name that is no longer a child raises AttributeError here, and ``nn.Module.__getattr__``
    answers as it always does.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        if torch.nn.Module.__getattr__ is not _MODULE_GETATTR:  # a tracer patched it (fx does,
            raise AttributeError(self.name)                      # to see modules): it answers
        try:
            return instance.__dict__[_CHILDREN][self.name]
        except KeyError:  # not a child (or torch keeps them elsewhere): nn.Module answers
            raise AttributeError(self.name) from None


# where dynamo refuses a class attribute it does not know (before torch 2.14), children are
# found by nn.Module.__getattr__, as in any module
_CHILD_DESCRIPTORS = torch_compat.dynamo_traces_class_descriptors()


def _look_up_children_fast(cls: type, gm: fx.GraphModule) -> None:
    """A :class:`_Child` on ``gm``'s own class for each child module whose name the class
    does not use otherwise (torch 2.14 and later)."""
    if not _CHILD_DESCRIPTORS:
        return
    for name in torch_compat.own_children(gm):
        if not hasattr(cls, name):
            setattr(cls, name, _Child(name))


class _PendingForward:
    """``forward`` of a module whose code is not generated yet: generates it when looked up.

    Each GraphModule has a class of its own, so the class attribute knows its module:
    ``gm.forward(x)``, ``type(gm).forward.__code__`` and ``inspect`` see the real code.
    """

    def __init__(self, gm: DebugGraphModule) -> None:
        self._gm = weakref.ref(gm)

    def __get__(self, instance, owner):
        gm = self._gm()
        if gm is not None:
            gm._realize()
        forward = owner.__dict__.get("forward")
        if forward is self:  # the module is gone: nothing can be generated for it
            raise AttributeError("forward: the GraphModule this code belonged to was deleted")
        return forward.__get__(instance, owner)


def _target_id(target) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _rebuild(rebuild, rebuild_args, meta, gm_meta):
    """Undo what torch's re-trace on load loses: node names and fxdebug's node meta."""
    plain = rebuild(*rebuild_args)
    gm = DebugGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    nodes = list(gm.graph.nodes)
    shape = [(node.op, _target_id(node.target)) for node in nodes]
    if shape == [(op, target) for _, op, target, _ in meta]:
        graph = fx.Graph(tracer_cls=torch_compat.graph_tracer_cls(gm.graph))
        torch_compat.copy_codegen(gm.graph, graph)
        copies: dict[fx.Node, fx.Node] = {}
        for node, (name, _, _, node_meta) in zip(nodes, meta):
            args = fx.node.map_arg(node.args, copies.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, copies.__getitem__)
            new = graph.create_node(node.op, node.target, args, kwargs, name=name,
                                    type_expr=node.type)
            new.meta.update(node.meta)
            new.meta.update(node_meta)
            copies[node] = new
        gm.graph = graph
    gm.meta.update(gm_meta)
    return gm


def _failing_node(gm: fx.GraphModule, exc: BaseException):
    """The node whose generated line raised ``exc`` and that frame's locals."""
    code = type(gm).forward.__code__
    tb = exc.__traceback__
    found = None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            found = tb
        tb = tb.tb_next
    if found is None:
        return None, {}
    first_line = torch_compat.def_line(torch_compat.generated_code(gm)) + 1  # 1-based, as tb_lineno
    index = torch_compat.lineno_map(gm).get(found.tb_lineno - first_line)
    if index is None:
        return None, {}
    nodes = list(gm.graph.nodes)
    return (nodes[index] if 0 <= index < len(nodes) else None), found.tb_frame.f_locals


def _called_with(gm: fx.GraphModule, args: tuple, kwargs: dict) -> str:
    """``x: 1x3x64x64 float32``: the module's inputs by placeholder name, as it was called."""
    names = [node.target for node in gm.graph.nodes if node.op == "placeholder"]
    given = list(zip(names, args)) + [(name, value) for name, value in kwargs.items()]
    return ", ".join(f"{str(name).lstrip('*')}: {value_text(value)}" for name, value in given)


def _annotate(gm: fx.GraphModule, exc: BaseException, args: tuple = (), kwargs=None) -> None:
    if any(str(note).startswith(_NOTE_MARK) for note in getattr(exc, "__notes__", ())):
        return
    node, local_vars = _failing_node(gm, exc)
    if node is None:
        return
    inputs = []
    for arg in node.all_input_nodes:
        if arg.name in local_vars:
            inputs.append(f"{arg.meta.get(META_KEY, arg.name)}: {value_text(local_vars[arg.name])}")
    where = node.meta.get(META_SOURCE)
    inputs_text = f" with inputs {', '.join(inputs)}" if inputs else ""
    exc.add_note(
        f"{_NOTE_MARK}failed at node {node.meta.get(META_KEY, node.name)!r} "
        f"({op_name(node, gm)}, {format_location(where) if where else 'no source line'})"
        f"{inputs_text}; the module was called with {_called_with(gm, args, kwargs or {}) or 'no inputs'}. "
        f"Check that the model inputs have the shape and dtype this node expects; "
        f"print(gm.code) shows the generated forward.")


def lazy_graph_module(root, graph: fx.Graph, class_name: str, lazy: bool = True
                      ) -> DebugGraphModule:
    """``DebugGraphModule(root, graph, class_name)``, its code generated on first use if ``lazy``."""
    DebugGraphModule._defer_recompile = lazy
    try:
        gm = DebugGraphModule(root, graph, class_name=class_name)
    finally:
        DebugGraphModule._defer_recompile = False
    if isinstance(root, torch.nn.Module):
        _keep_non_persistent_buffers(root, gm)
    return gm


def _keep_non_persistent_buffers(root: torch.nn.Module, gm: fx.GraphModule) -> None:
    """A buffer ``root`` keeps out of its ``state_dict`` stays out of ``gm``'s (torch 2.9's
    GraphModule copies every buffer as persistent; later releases keep the flag)."""
    for node in gm.graph.find_nodes(op="get_attr"):
        owner_path, _, name = str(node.target).rpartition(".")
        try:
            owner, copy_owner = root.get_submodule(owner_path), gm.get_submodule(owner_path)
        except AttributeError:
            continue
        if owner is copy_owner or name not in dict(owner.named_buffers(recurse=False)):
            continue  # a module gm shares with root is right already
        if not torch_compat.is_persistent_buffer(owner, name) and \
                torch_compat.is_persistent_buffer(copy_owner, name):
            copy_owner.register_buffer(name, getattr(copy_owner, name), persistent=False)


def keyed_copy(gm: fx.GraphModule, recompile: bool = True) -> DebugGraphModule:
    """A DebugGraphModule sharing ``gm``'s parameters, with its own graph and a key on every node.

    Passes edit the copy's graph; ``gm`` (perhaps the user's own GraphModule,
    or one traced by plain ``torch.fx``) is never changed. ``recompile=False``
    defers the code to its first use (see ``DebugGraphModule.defer_recompile``).

    >>> import torch
    >>> plain = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> twin = keyed_copy(plain)
    >>> twin.graph is plain.graph, [n.meta["fxdebug_key"] for n in twin.graph.nodes]
    (False, ['input', '0', 'output'])
    """
    graph = copy.deepcopy(gm.graph)
    new = lazy_graph_module(gm, graph, type(gm).__name__.replace("GraphModuleImpl", "")
                            or "GraphModule", lazy=not recompile)
    new.meta.update({key: value for key, value in getattr(gm, "meta", {}).items()
                     if key != MODES_META})
    assign_missing_keys(new.graph)
    return new
