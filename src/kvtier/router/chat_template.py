"""What a chat template reads, as vLLM 0.32 analyses it (vllm/renderers/hf.py): it decides the
form of the conversation vLLM hands the template (content as text or as parts, developer
messages as they are or as system messages). Results are cached per template."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jinja2 import nodes

__all__ = ["names_developer_role", "takes_content_parts"]


@lru_cache(maxsize=8)
def names_developer_role(template: str) -> bool:
    """Whether `template` names the developer role (as a quoted string), so that vLLM hands it
    developer messages as they are rather than as system messages."""
    return '"developer"' in template or "'developer'" in template


@lru_cache(maxsize=8)
def takes_content_parts(template: str) -> bool:
    """Whether vLLM hands `template` message content as a list of parts (its "openai" content
    format) rather than as text: when the template loops over a message's content, as vLLM's
    `_detect_content_format` finds such loops in the template's syntax tree. Text (vLLM's
    default) for a template that does not parse or whose loop it cannot follow."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
        return _loops_over_content(tree)
    except (TemplateError, ValueError):
        return False


def _loops_over_content(tree: nodes.Template) -> bool:
    """Whether a `for` loop iterates over a message's content: `message.content` of a loop
    variable over the messages, a macro parameter that calls pass a message's content to, or a
    variable named `content` outside macros. Raises ValueError where vLLM's walk fails (a loop
    or assignment target that is not one name)."""
    from jinja2 import nodes

    messages = _aliases(tree, "messages")
    message_names = [
        _target(loop.target)
        for loop in tree.find_all(nodes.For)
        if any(_reads(loop.iter, name) for name in messages)
    ]
    params, in_macros = _macro_content_params(tree, message_names)
    for loop in tree.find_all(nodes.For):
        iterated = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
        if (
            any(_reads(loop.iter, name, "content") for name in message_names)
            or iterated in params.get(id(loop), ())
            or (iterated == "content" and id(loop) not in in_macros)
        ):
            _target(loop.target)
            return True
    return False


def _macro_content_params(
    tree: nodes.Template, message_names: list[str]
) -> tuple[dict[int, set[str]], set[int]]:
    """The parameters that calls pass a message's content to, by the id of each loop inside
    their macro; and the ids of all loops inside macros."""
    from jinja2 import nodes

    params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        passed = set()
        for call in tree.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                given = [*zip(names, call.args, strict=False)]
                given += [(kw.key, kw.value) for kw in call.kwargs if kw.key in names]
                passed |= {
                    name
                    for name, value in given
                    if any(_reads(value, m, "content") for m in message_names)
                }
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if passed:
                params[id(loop)] = passed
    return params, in_macros


def _aliases(tree: nodes.Template, name: str) -> set[str]:
    """`name` and the variables assigned from it (through filters, tests and slices), again
    and again."""
    from jinja2 import nodes

    found, todo = {name}, [name]
    while todo:
        current = todo.pop()
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, current) and (alias := _target(assign.target)) not in found:
                found.add(alias)
                todo.append(alias)
    return found


def _target(node: nodes.Node) -> str:
    from jinja2 import nodes

    if not isinstance(node, nodes.Name):
        raise ValueError("a loop or assignment target that is not one name")
    return node.name


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` reads variable `name` (its `key` item or attribute, with a key), through
    filters, tests and slices (vLLM's `_is_var_or_elems_access`)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    return isinstance(node, nodes.Getattr) and _is_name(node.node, name) and node.attr == key


def _is_name(node: nodes.Node, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
