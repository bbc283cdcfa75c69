"""What kube-apiserver checks of a CustomResourceDefinition, modelled for tests without one.

Why: a CRD that a JSON-schema validator accepts can still be refused by the
API server, which checks far more at creation (structural schema rules, every
``default`` against its own schema and its CEL rules, CEL compilation and
estimated cost) and runs the CEL rules on every object it admits. No API
server runs on a developer machine, so this module does the checks we can
reproduce; the ``k8s`` suite applies the CRD to a real one.

Sources, read from the Kubernetes tree (``staging/src/k8s.io/apiextensions-apiserver``):

* ``pkg/apiserver/schema/validation.go`` (``ValidateStructural``): every
  node has a ``type`` unless it is int-or-string or preserves unknown
  fields; ``metadata`` at the root may only restrict ``name`` and
  ``generateName``; no ``additionalProperties`` at the root.
* ``pkg/apis/apiextensions/validation/validation.go``:
  ``additionalProperties`` and ``properties`` are mutually exclusive;
  ``uniqueItems``, ``$ref``, ``patternProperties`` ... are forbidden;
  list-map keys are scalar and required or defaulted; a rule with a line
  break needs a message; ``oldSelf`` only where old and new values
  correlate; per-rule estimated cost (times the rule's cardinality) at
  most ``StaticEstimatedCostLimit`` = 10,000,000 and the CRD's total at most
  ``StaticEstimatedCRDCostLimit`` = 100,000,000.
* ``pkg/apiserver/schema/defaulting/validation.go`` (``ValidateDefaults``):
  each default *as written* (nested defaults are not applied to it) must be
  pruned-equal, valid against its node's schema, and pass the CEL rules of
  its node's subtree, evaluated with ``self`` = ``oldSelf`` = the default.
  A rule that reads a field the default lacks fails there with
  ``no such key``.
* ``pkg/apiserver/schema/defaulting/algorithm.go`` (``Default``): at
  admission, unknown fields are pruned, then defaults are applied top-down:
  a defaulted object gets its own nested defaults too.
* cel-go ``common/cost.go``: a select or identifier costs 1, traversing a
  string costs 0.1 per byte; an unbounded string or list is sized by the
  3 MiB request limit.

CEL is evaluated by ``cel-python`` (a pure-Python implementation of the
language the API server runs through cel-go); static checks (declared
fields, functions, cost) walk its parse tree.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import celpy
import jsonschema
import re2
from lark import Token, Tree

REQUEST_LIMIT = 3 * 1024 * 1024  # bytes: sizes unbounded strings, lists and maps
PER_RULE_COST_LIMIT = 10_000_000  # StaticEstimatedCostLimit
PER_CRD_COST_LIMIT = 100_000_000  # StaticEstimatedCRDCostLimit
STRING_TRAVERSAL_COST = 0.1  # cel-go StringTraversalCostFactor
OPENAPI_TYPES = {"string", "number", "integer", "boolean", "array", "object"}
FORBIDDEN_KEYWORDS = {
    "id",
    "$ref",
    "definitions",
    "dependencies",
    "patternProperties",
    "additionalItems",
}
VALIDATION_REASONS = {
    "FieldValueRequired",
    "FieldValueForbidden",
    "FieldValueInvalid",
    "FieldValueDuplicate",
}
# Macros and functions of the CEL standard definitions, which every Kubernetes
# version with CRD validation rules has. A rule using anything else must be
# checked against the oldest supported version's libraries before it is added
# here.
MACROS = {"all", "exists", "exists_one", "map", "filter"}
STANDARD_FUNCTIONS = MACROS | {
    "has",
    "size",
    "matches",
    "startsWith",
    "endsWith",
    "contains",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "bool",
    "type",
    "dyn",
    "duration",
    "timestamp",
}
# Parse-tree nodes of cel-python's grammar that are one CEL operation each;
# "||", "&&" and "?:" are too when their node has more than one operand.
_COMPARISONS = {
    "relation_lt",
    "relation_le",
    "relation_gt",
    "relation_ge",
    "relation_eq",
    "relation_ne",
    "relation_in",
}
_CALLS = {"member_dot_arg", "ident_arg"}
_OPERATIONS = (
    _COMPARISONS
    | _CALLS
    | {
        "addition_add",
        "addition_sub",
        "multiplication_mul",
        "multiplication_div",
        "multiplication_mod",
        "unary_not",
        "unary_neg",
        "member_dot",
        "member_index",
        "ident",
    }
)
_LOGICAL = {"conditionalor", "conditionaland", "expr"}
_LITERALS = {"list_lit", "map_lit"}

_ENV = celpy.Environment()


def to_json_schema(node: Any) -> Any:
    """A CRD's structural schema as plain JSON Schema (int-or-string as anyOf)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@dataclass(frozen=True, slots=True)
class Site:
    """One schema node, where it sits, and how many times it can occur in one object."""

    path: str  # dotted, "[]" for list items, "{}" for map values; "" is the root
    node: Mapping[str, Any]
    cardinality: int  # product of the maxItems/maxProperties above it (unbounded: 3 MiB)
    correlatable: bool  # old and new values can be paired (oldSelf allowed)


def walk(node: Mapping[str, Any], path: str = "", cardinality: int = 1, correlatable: bool = True):
    """Every schema node under ``node``, depth first."""
    yield Site(path, node, cardinality, correlatable)
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}" if path else name, cardinality, correlatable)
    items = node.get("items")
    if isinstance(items, dict):
        count = cardinality * node.get("maxItems", REQUEST_LIMIT)
        is_map_list = node.get("x-kubernetes-list-type") == "map"
        yield from walk(items, f"{path}[]", count, correlatable and is_map_list)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        count = cardinality * node.get("maxProperties", REQUEST_LIMIT)
        atomic = node.get("x-kubernetes-map-type") == "atomic"
        yield from walk(extra, f"{path}{{}}", count, correlatable and not atomic)


def _where(path: str) -> str:
    return path or "<root>"


# -- structural schema ---------------------------------------------------------


def structural_errors(schema: Mapping[str, Any]) -> list[str]:
    """What CRD creation refuses in the schema's shape (empty when it would accept it)."""
    errors: list[str] = []
    if schema.get("type") != "object":
        errors.append("<root>: type must be object")
    if "additionalProperties" in schema:
        errors.append("<root>: additionalProperties must not be used at the root")
    if schema.get("nullable"):
        errors.append("<root>: nullable cannot be true at the root")
    errors += _root_meta_errors(schema)
    for site in walk(schema):
        errors += _node_errors(site)
    return errors


def _root_meta_errors(schema: Mapping[str, Any]) -> list[str]:
    errors: list[str] = []
    props = schema.get("properties") or {}
    for name in ("apiVersion", "kind"):
        if name in props and props[name].get("type") != "string":
            errors.append(f"{name}: must be string")
    for name in ("apiVersion", "kind", "metadata"):
        for site in walk(props.get(name) or {}, name):
            if "default" in site.node:
                errors.append(f"{site.path}: default must not be set in top-level {name}")
    metadata = props.get("metadata")
    if metadata is not None:
        if metadata.get("type") != "object":
            errors.append("metadata: must be object")
        extra = set(metadata) - {"type", "properties"}
        named = set(metadata.get("properties") or {}) - {"name", "generateName"}
        if extra or named:
            errors.append(
                "metadata: must not specify anything other than name and generateName, "
                f"found {sorted(extra | named)}"
            )
    return errors


def _node_errors(site: Site) -> list[str]:
    node, where = site.node, _where(site.path)
    errors: list[str] = []
    kind = node.get("type")
    int_or_string = bool(node.get("x-kubernetes-int-or-string"))
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if kind is None and not int_or_string and not preserve:
        errors.append(f"{where}: type must not be empty for specified fields")
    if kind is not None and kind not in OPENAPI_TYPES:
        errors.append(f"{where}: type {kind!r} is not an OpenAPI v3 type")
    if int_or_string and kind is not None:
        errors.append(f"{where}: x-kubernetes-int-or-string takes no type")
    if int_or_string and preserve:
        errors.append(f"{where}: preserve-unknown-fields must be false with int-or-string")
    if preserve is not None and preserve is not True:
        errors.append(f"{where}: x-kubernetes-preserve-unknown-fields must be true or undefined")
    if kind == "array" and not isinstance(node.get("items"), dict):
        errors.append(f"{where}: items must be one schema")
    extra = node.get("additionalProperties")
    if extra is not None and node.get("properties"):
        errors.append(f"{where}: additionalProperties and properties are mutually exclusive")
    if extra is False:
        errors.append(f"{where}: additionalProperties: false is not structural")
    if node.get("uniqueItems"):
        errors.append(f"{where}: uniqueItems cannot be set to true")
    for keyword in sorted(FORBIDDEN_KEYWORDS & set(node)):
        errors.append(f"{where}: {keyword} is not supported")
    for keyword in ("oneOf", "anyOf", "allOf", "not"):
        if keyword in node:  # allowed by the API server with care; this CRD says it with CEL
            errors.append(f"{where}: {keyword}: use x-kubernetes-validations instead")
    if "pattern" in node:
        try:
            re2.compile(node["pattern"])  # the API server compiles patterns as Go (RE2) regexps
        except re2.error as exc:
            errors.append(f"{where}: pattern is not a valid RE2 regexp: {exc}")
    errors += _list_type_errors(node, where)
    for rule in node.get("x-kubernetes-validations") or []:
        errors += [f"{where}: {e}" for e in _rule_entry_errors(rule)]
    return errors


def _list_type_errors(node: Mapping[str, Any], where: str) -> list[str]:
    errors: list[str] = []
    list_type = node.get("x-kubernetes-list-type")
    keys = node.get("x-kubernetes-list-map-keys") or []
    if list_type is not None and list_type not in {"atomic", "set", "map"}:
        errors.append(f"{where}: x-kubernetes-list-type {list_type!r} is not atomic/set/map")
    if keys and list_type != "map":
        errors.append(f"{where}: x-kubernetes-list-map-keys needs x-kubernetes-list-type: map")
    if list_type == "map":
        items = node.get("items") or {}
        if not keys:
            errors.append(f"{where}: x-kubernetes-list-type map needs list-map-keys")
        if items.get("type") != "object":
            errors.append(f"{where}: items of a map list must be objects")
        props, required = items.get("properties") or {}, set(items.get("required") or [])
        for key in keys:
            prop = props.get(key)
            if prop is None:
                errors.append(f"{where}: list-map key {key!r} is not an item property")
            elif prop.get("type") in {"array", "object"}:
                errors.append(f"{where}: list-map key {key!r} must be a scalar")
            elif key not in required and "default" not in prop:
                errors.append(f"{where}: list-map key {key!r} must be required or defaulted")
    map_type = node.get("x-kubernetes-map-type")
    if map_type is not None and map_type not in {"atomic", "granular"}:
        errors.append(f"{where}: x-kubernetes-map-type {map_type!r} is not atomic/granular")
    return errors


def _rule_entry_errors(rule: Mapping[str, Any]) -> list[str]:
    text, message = str(rule.get("rule", "")).strip(), str(rule.get("message", ""))
    errors: list[str] = []
    if not text:
        errors.append("x-kubernetes-validations: rule is not specified")
    if "\n" in message.strip() or "\r" in message.strip():
        errors.append("x-kubernetes-validations: message must not contain line breaks")
    if ("\n" in text or "\r" in text) and not message.strip():
        errors.append("x-kubernetes-validations: a rule with line breaks needs a message")
    if "reason" in rule and rule["reason"] not in VALIDATION_REASONS:
        errors.append(f"x-kubernetes-validations: reason {rule['reason']!r} is not supported")
    return errors


# -- CEL rules: compile, static checks, cost -----------------------------------


@dataclass(slots=True)
class Rule:
    """One ``x-kubernetes-validations`` entry, compiled."""

    site: Site
    text: str
    message: str
    tree: Tree
    program: Any  # celpy Runner
    transition: bool  # reads oldSelf: only evaluated where an old value exists

    def evaluate(self, value: Any, old: Any = None) -> str | None:
        """None when the rule holds on ``value``; else what the API server would answer."""
        activation = {"self": celpy.json_to_cel(value)}
        if self.transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = self.program.evaluate(activation)
        except celpy.CELEvalError as exc:
            result = exc
        if isinstance(result, celpy.CELEvalError):
            return f"{result.args[0]} evaluating rule: {self.message or self.text}"
        if result is True or result == celpy.celtypes.BoolType(True):
            return None
        return self.message or f"failed rule: {self.text}"


_COMPILED: dict[str, tuple[Tree, Any]] = {}


def _compile(text: str) -> tuple[Tree, Any]:
    if text not in _COMPILED:
        tree = _ENV.compile(text)
        _COMPILED[text] = (tree, _ENV.program(tree))
    return _COMPILED[text]


def rules(schema: Mapping[str, Any]) -> list[Rule]:
    """Every rule of the schema, compiled; raises ``celpy.CELParseError`` for bad syntax."""
    out: list[Rule] = []
    for site in walk(schema):
        for entry in site.node.get("x-kubernetes-validations") or []:
            out.append(_rule(site, entry))
    return out


def _rule(site: Site, entry: Mapping[str, Any]) -> Rule:
    tree, program = _compile(entry["rule"])
    reads_old = any(
        isinstance(t, Token) and t.value == "oldSelf" for t in tree.scan_values(lambda _: True)
    )
    return Rule(site, entry["rule"], entry.get("message", ""), tree, program, reads_old)


@dataclass(slots=True)
class _Analysis:
    """What one walk over a rule's parse tree found."""

    errors: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    operations: int = 0
    longest_string: int = 1  # bytes: the longest string an operation may traverse
    iterations: int = 1  # product of the list sizes the rule's macros range over


def static_errors(rule: Rule) -> list[str]:
    """What CEL compilation at CRD creation refuses: undeclared fields, unknown functions,
    ``oldSelf`` where old and new values do not correlate."""
    found = _analyse(rule)
    where = _where(rule.site.path)
    errors = [f"{where}: {e} in rule {rule.text!r}" for e in sorted(found.errors)]
    unknown = found.functions - STANDARD_FUNCTIONS
    if unknown:
        errors.append(
            f"{where}: {sorted(unknown)} not known to every supported Kubernetes version "
            f"(rule {rule.text!r})"
        )
    if rule.transition and not rule.site.correlatable:
        errors.append(f"{where}: oldSelf on an uncorrelatable part of the schema")
    return errors


def estimated_cost(rule: Rule) -> int:
    """A bound from above of the API server's estimate for one rule, times its cardinality.

    Every operation is charged 1 plus a full traversal of the longest string
    any comparison or function in the rule may touch (:func:`_charged_size`;
    ``has()`` traverses nothing), a list or map literal 30 (cel-go: 10 and 30), and every macro
    multiplies by the bound of the list it ranges over (plus its own loop
    step). cel-go charges each operation only for its own operands, so its
    estimate should not exceed this one; the real check is the ``k8s`` suite
    applying the CRD.
    """
    found = _analyse(rule)
    per_operation = 1 + math.ceil(STRING_TRAVERSAL_COST * found.longest_string)
    return found.operations * per_operation * found.iterations * rule.site.cardinality


def _analyse(rule: Rule) -> _Analysis:
    found = _Analysis()
    scope = {"self": rule.site.node, "oldSelf": rule.site.node}
    _visit(rule.tree, scope, found, in_has=False)
    return found


def _visit(tree: Tree, scope: dict[str, Any], found: _Analysis, in_has: bool) -> None:
    if tree.data in _OPERATIONS or (tree.data in _LOGICAL and len(tree.children) > 1):
        found.operations += 1
    if tree.data in _LITERALS:
        found.operations += 30
    if not in_has and (tree.data in _CALLS or _comparison(tree) is not None):
        found.longest_string = max(found.longest_string, _charged_size(tree, scope))
    if tree.data == "member_dot":
        _resolve(tree, scope, found)
    if tree.data == "ident_arg":
        name = str(tree.children[0])
        found.functions.add(name)
        for child in tree.children[1:]:
            if isinstance(child, Tree):
                _visit(child, scope, found, in_has or name == "has")
        return
    if tree.data == "member_dot_arg":
        target, method = tree.children[0], str(tree.children[1])
        found.functions.add(method)
        args = tree.children[2].children if len(tree.children) > 2 else []
        _visit(target, scope, found, in_has)
        variable = _bare_ident(args[0]) if args else None
        if method in MACROS and variable is not None:
            schema = _resolve(target, scope, found)
            found.iterations *= max(2, _max_items(schema)) + 1
            inner = {**scope, variable: _element(schema)}
            found.operations += 3  # the loop step: bind, test, accumulate
            for arg in args[1:]:
                _visit(arg, inner, found, in_has)
            return
        for arg in args:
            _visit(arg, scope, found, in_has)
        return
    for child in tree.children:
        if isinstance(child, Tree):
            _visit(child, scope, found, in_has)


# Functions that traverse nothing, whatever their argument's size: a field's
# presence, a value's type and a string's or list's size (cel-go charges each
# a constant).
_CONSTANT_COST = {"has", "type", "size"}


def _comparison(tree: Tree) -> tuple[str, Tree, Tree] | None:
    """(operator, left, right) when ``tree`` is a binary comparison: cel-python
    parses ``a == b`` as ``relation(relation_eq(a), b)``."""
    if tree.data != "relation" or len(tree.children) != 2:
        return None
    left, right = tree.children
    if not (isinstance(left, Tree) and left.data in _COMPARISONS and isinstance(right, Tree)):
        return None
    return left.data, left.children[0], right


def _charged_size(tree: Tree, scope: dict[str, Any]) -> int:
    """Bytes one operation may traverse, as cel-go ``checker/cost.go`` charges
    them: a comparison (``Equals``, ``NotEquals``, the orderings) by its
    smaller operand, so a field compared with a literal costs the literal's
    length; ``in`` a list literal by the list's elements, each compared with
    the value (``InList`` charges the list's size, independent of the value's);
    ``has()``, ``type()`` and ``size()`` nothing; any other call by its largest operand."""
    compared = _comparison(tree)
    if compared is not None:
        operator, left, right = compared
        items = _list_literal_items(right) if operator == "relation_in" else None
        if items is not None:
            longest_item = max((_max_size(item, scope) for item in items), default=1)
            return min(_max_size(left, scope), longest_item)
        sizes = [_max_size(left, scope), _max_size(right, scope)]
        return max(sizes) if operator == "relation_in" else min(sizes)
    if tree.data == "ident_arg" and str(tree.children[0]) in _CONSTANT_COST:
        return 1
    return max((_max_size(operand, scope) for operand in _call_operands(tree)), default=1)


def _list_literal_items(tree: Tree) -> list[Tree] | None:
    """The elements of ``tree`` when it is nothing but a list literal, else None."""
    while isinstance(tree, Tree) and len(tree.children) == 1 and tree.data != "list_lit":
        tree = tree.children[0]
    if not isinstance(tree, Tree) or tree.data != "list_lit":
        return None
    items = tree.children[0].children if tree.children else []
    return [item for item in items if isinstance(item, Tree)]


def _call_operands(tree: Tree) -> list[Tree]:
    """The operands a call (``ident_arg`` or ``member_dot_arg``) may traverse:
    its target and arguments, not a macro's list (counted apart)."""
    if tree.data == "ident_arg":
        args = tree.children[1:]
    else:
        if str(tree.children[1]) in MACROS:
            return []
        args = [tree.children[0], *tree.children[2:]]
    operands: list[Tree] = []
    for arg in args:
        if isinstance(arg, Tree):
            operands += arg.children if arg.data == "exprlist" else [arg]
    return [o for o in operands if isinstance(o, Tree)]


def _bare_ident(tree: Tree) -> str | None:
    """The identifier name when ``tree`` is nothing but one identifier."""
    while isinstance(tree, Tree) and len(tree.children) == 1:
        if tree.data == "ident":
            return str(tree.children[0])
        tree = tree.children[0]
    return None


def _resolve(tree: Tree, scope: dict[str, Any], found: _Analysis) -> Mapping[str, Any] | None:
    """The schema node a member expression reads, or None when it is not a field path."""
    if tree.data in {"member", "primary", "unary", "multiplication", "addition"} | {
        "relation",
        "conditionaland",
        "conditionalor",
        "expr",
    }:
        return _resolve(tree.children[0], scope, found) if len(tree.children) == 1 else None
    if tree.data == "ident":
        return scope.get(str(tree.children[0]))
    if tree.data == "member_dot":
        base = _resolve(tree.children[0], scope, found)
        name = str(tree.children[1])
        if base is None:
            return None
        props = base.get("properties") or {}
        if name in props:
            return props[name]
        if isinstance(base.get("additionalProperties"), dict):
            return base["additionalProperties"]
        if not base.get("x-kubernetes-preserve-unknown-fields"):
            found.errors.add(f"undefined field {name!r}")
        return None
    if tree.data == "member_index":
        return _element(_resolve(tree.children[0], scope, found))
    return None


def _element(schema: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The schema of a list's items or a map's values (a map's macros range over keys)."""
    if schema is None:
        return None
    if isinstance(schema.get("items"), dict):
        return schema["items"]
    if isinstance(schema.get("additionalProperties"), dict):
        return {"type": "string"}
    return None


def _max_items(schema: Mapping[str, Any] | None) -> int:
    if schema is None:
        return REQUEST_LIMIT
    return int(schema.get("maxItems", schema.get("maxProperties", REQUEST_LIMIT)))


# CEL's type values (``type(x) == int``: how the Kubernetes docs test an
# int-or-string field): compared in constant time, never traversed.
TYPE_NAMES = {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type"}


def _max_size(tree: Tree, scope: dict[str, Any]) -> int:
    """Bytes of the longest value ``tree`` can be: a literal's length or its field's bound."""
    literal = _literal(tree)
    if literal is not None:
        return len(literal)
    if _is_type_value(tree, scope):
        return 1
    schema = _resolve(tree, scope, _Analysis())
    if schema is None:
        return REQUEST_LIMIT  # a computed value: assume the largest
    kind = schema.get("type")
    if kind in {"integer", "number", "boolean"}:
        return 1
    if schema.get("x-kubernetes-int-or-string"):
        # Sized by the request limit whatever its maxLength: Kubernetes 1.29
        # (apiserver pkg/cel/common/schemas.go, SchemaDeclType) does not read
        # maxLength for int-or-string; later versions do.
        return REQUEST_LIMIT
    if kind == "string":
        if "maxLength" in schema:
            return int(schema["maxLength"])
        if "enum" in schema:
            return max(len(str(v)) for v in schema["enum"])
        return REQUEST_LIMIT
    return REQUEST_LIMIT  # lists and objects compared whole


def _is_type_value(tree: Tree, scope: dict[str, Any]) -> bool:
    """Whether ``tree`` is a call of ``type()`` or a type's name (not a variable)."""
    while isinstance(tree, Tree) and len(tree.children) == 1:
        tree = tree.children[0]
    if not isinstance(tree, Tree):
        return False
    if tree.data == "ident_arg":
        return str(tree.children[0]) == "type"
    name = _bare_ident(tree)
    return name in TYPE_NAMES and name not in scope


def _literal(tree: Tree) -> str | None:
    while isinstance(tree, Tree) and len(tree.children) == 1:
        if tree.data == "literal":
            return str(tree.children[0])
        tree = tree.children[0]
    return None


# -- defaults and admission ----------------------------------------------------


def prune(value: Any, node: Mapping[str, Any], root: bool = False) -> Any:
    """Drop the fields the schema does not declare, as the API server does on write."""
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        keep_unknown = node.get("x-kubernetes-preserve-unknown-fields") is True
        out = {}
        for key, item in value.items():
            if root and key in {"apiVersion", "kind", "metadata"}:
                out[key] = item
            elif key in props:
                out[key] = prune(item, props[key])
            elif isinstance(extra, dict):
                out[key] = prune(item, extra)
            elif keep_unknown or extra is True:
                out[key] = item
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [prune(item, node["items"]) for item in value]
    return value


def apply_defaults(value: Any, node: Mapping[str, Any]) -> Any:
    """Fill absent fields with their defaults, top-down: a default's own nested defaults too."""
    if isinstance(value, dict):
        props = node.get("properties") or {}
        for key, prop in props.items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
        for key in value:
            if key in props:
                value[key] = apply_defaults(value[key], props[key])
            elif isinstance(node.get("additionalProperties"), dict):
                value[key] = apply_defaults(value[key], node["additionalProperties"])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(item, node["items"]) for item in value]
    return value


def cel_errors(node: Mapping[str, Any], value: Any, old: Any = None, path: str = "") -> list[str]:
    """Every rule under ``node`` evaluated on ``value`` (``old``: the stored object, if any)."""
    errors: list[str] = []
    site = Site(path, node, 1, True)
    for entry in node.get("x-kubernetes-validations") or []:
        rule = _rule(site, entry)
        if rule.transition and old is None:
            continue  # transition rules only run on updates
        answer = rule.evaluate(value, old)
        if answer is not None:
            errors.append(f"{path}: {answer}" if path else answer)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, item in value.items():
            child = props.get(key) or (extra if isinstance(extra, dict) else None)
            if child is not None:
                before = old.get(key) if isinstance(old, dict) else None
                errors += cel_errors(child, item, before, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            errors += cel_errors(node["items"], item, None, f"{path}[{index}]")
    return errors


def schema_errors(node: Mapping[str, Any], value: Any) -> list[str]:
    """The OpenAPI value validation (types, enums, patterns, bounds, required)."""
    validator = jsonschema.Draft7Validator(to_json_schema(node))
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<value>'}: {e.message}"
        for e in validator.iter_errors(value)
    ]


def default_errors(schema: Mapping[str, Any]) -> list[str]:
    """What CRD creation checks of every ``default``, each taken as written."""
    errors: list[str] = []
    for site in walk(schema):
        if "default" not in site.node:
            continue
        default, where = site.node["default"], f"{_where(site.path)}.default"
        if prune(copy.deepcopy(default), site.node) != default:
            errors.append(f"{where}: must not have unknown fields")
            continue
        found = schema_errors(site.node, default)
        if found:
            errors += [f"{where}: {e}" for e in found]
            continue
        # The API server passes the default as both the new and the old value.
        errors += [f"{where}: {e}" for e in cel_errors(site.node, default, old=default)]
    return errors


def admit(schema: Mapping[str, Any], obj: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A create as the API server handles it: prune, default, validate, run the CEL rules.

    Returns the object as it would be stored and the errors that would refuse it.
    """
    stored = apply_defaults(prune(copy.deepcopy(dict(obj)), schema, root=True), schema)
    errors = schema_errors(schema, stored)
    if not errors:
        errors = cel_errors(schema, stored)
    return stored, errors


def crd_schema(crd: Mapping[str, Any], version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of ``version`` (default: the storage version)."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version or (version is None and entry.get("storage")):
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def iter_defaults(schema: Mapping[str, Any]) -> Iterator[Site]:
    """The sites that carry a default (for parametrized tests)."""
    return (site for site in walk(schema) if "default" in site.node)
