"""The deployment template (azure.yaml, infra/*.bicep), checked without Azure or the Bicep CLI.

Every .bicep file is parsed with the tree-sitter Bicep grammar and must parse cleanly. The security
and platform facts are then read from the parse tree, never from raw text, so a line that is
commented out does not count: a small evaluator turns declarations into Python values, and follows
variables, parameters (by their defaults or a chosen mode), ``concat``, ``union``, ``mapValues``,
``?:``, arithmetic, resource loops and ``fail(...)``, so the app settings, role assignments and
private endpoints are checked exactly as each upstream mode and option would produce them, the app
settings through the module that writes them (with the site's current settings as a test chooses).
Beside the templates, the checks read the docs whose statements depend on them (docs/scaling.md,
docs/deploy.md) and function_app.py's routes.

Each check is a plain function that raises AssertionError. ``test_check_catches`` breaks the
templates on purpose, one fact at a time, and requires the matching check to fail; so none of these
checks can pass vacuously."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

tree_sitter = pytest.importorskip("tree_sitter")
tree_sitter_bicep = pytest.importorskip("tree_sitter_bicep")

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"

STORAGE_BLOB_DATA_OWNER = "b7e6dc6d-f1e8-4753-8033-0f276bb0955b"
MONITORING_METRICS_PUBLISHER = "3913510d-42f4-4e42-8a64-420c390055eb"
COGNITIVE_SERVICES_OPENAI_USER = "5e0bd9bd-7b93-4f28-af87-19fc36ad61bd"
KEY_VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"
STORAGE_BLOB_DATA_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
STORAGE_TABLE_DATA_CONTRIBUTOR = "0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3"
# The app's own state in the host's storage account (names the app code uses).
APP_TABLES = ("chatstreamCallers", "chatstreamLimits", "chatstreamUsage", "chatstreamResponses", "chatstreamStreams")
STREAMS_CONTAINER = "chatstream-streams"
DEPLOYER = "deployer-object-id"  # a stand-in principalId
MODES = ("azureOpenAI", "openAI")

# Functions app settings reference, "Flex Consumption plan deprecations" (ms.date 2025-12-22): app
# settings and site properties that are not valid, or have moved, on that plan.
FLEX_DEPRECATED_SETTINGS = (
    "ENABLE_ORYX_BUILD",
    "FUNCTIONS_EXTENSION_VERSION",
    "FUNCTIONS_WORKER_RUNTIME",
    "FUNCTIONS_WORKER_RUNTIME_VERSION",
    "FUNCTIONS_MAX_HTTP_CONCURRENCY",
    "FUNCTIONS_WORKER_PROCESS_COUNT",
    "FUNCTIONS_WORKER_DYNAMIC_CONCURRENCY_ENABLED",
    "SCM_DO_BUILD_DURING_DEPLOYMENT",
    "WEBSITE_CONTENTAZUREFILECONNECTIONSTRING",
    "WEBSITE_CONTENTOVERVNET",
    "WEBSITE_CONTENTSHARE",
    "WEBSITE_DNS_SERVER",
    "WEBSITE_MAX_DYNAMIC_APPLICATION_SCALE_OUT",
    "WEBSITE_NODE_DEFAULT_VERSION",
    "WEBSITE_RUN_FROM_PACKAGE",
    "WEBSITE_SKIP_CONTENTSHARE_VALIDATION",
    "WEBSITE_VNET_ROUTE_ALL",
)
FLEX_DEPRECATED_PROPERTIES = (
    "alwaysOn",
    "containerSize",
    "dnsConfiguration",
    "ftpsState",
    "isReserved",
    "IsXenon",
    "javaVersion",
    "linuxFxVersion",
    "netFrameworkVersion",
    "powerShellVersion",
    "functionAppScaleLimit",
    "preWarmedInstanceCount",
    "use32BitWorkerProcess",
    "vnetBackupRestoreEnabled",
    "vnetContentShareEnabled",
    "vnetImagePullEnabled",
    "vnetRouteAllEnabled",
    "windowsFxVersion",
)
AZURE_FRONT_END_IDLE_SECONDS = 230  # Azure's load balancer drops an HTTP response silent this long

PARSER = tree_sitter.Parser(tree_sitter.Language(tree_sitter_bicep.language()))


# ---------------------------------------------------------------------------------------------
# Bicep → Python values
# ---------------------------------------------------------------------------------------------


class Symbolic(str):
    """A value only known at deployment (a resource property, an interpolation): its source text."""


class DeploymentFails(Exception):
    """The template's own ``fail(...)`` was reached: the deployment stops with this message."""


def _named(node) -> list:
    return [c for c in node.named_children if c.type != "comment"]


@dataclass
class Decl:
    kind: str  # param | var | resource | module | output
    name: str
    node: object  # the declaration node
    decorators: dict = field(default_factory=dict)  # name -> list of argument nodes
    type: str | None = None  # resource/module type string, param/output type
    condition: object = None  # the `if (...)` expression node of a conditional resource/module
    body: object = None  # value node: the object of a resource/module, a var/output/param default
    loop: tuple | None = None  # `[for (item, index) in items: ...]`: (item name, index name or None, items node)


@dataclass
class Template:
    path: str
    source: bytes
    tree: object
    decls: dict  # name -> Decl
    outputs: dict  # name -> Decl (outputs have their own namespace)

    @property
    def code(self) -> str:
        """The source with every comment blanked out."""
        text = bytearray(self.source)
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            if node.type == "comment":
                text[node.start_byte : node.end_byte] = b" " * (node.end_byte - node.start_byte)
            stack.extend(node.children)
        return text.decode()

    def of(self, kind: str) -> dict:
        return {n: d for n, d in self.decls.items() if d.kind == kind}

    def resources(self, type_prefix: str) -> list[Decl]:
        return [d for d in self.of("resource").values() if d.type.split("@")[0] == type_prefix]


def parse_errors(tree) -> list[str]:
    found, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            found.append(f"{node.type} at line {node.start_point[0] + 1}: {node.text[:60]!r}")
        stack.extend(node.children)
    return found


def load_template(path: str, source: bytes) -> Template:
    tree = PARSER.parse(source)
    decls, outputs, decorators = {}, {}, {}
    for node in _named(tree.root_node):
        if node.type == "decorators":
            for dec in _named(node):
                call = _named(dec)[0]
                if call.type == "call_expression":
                    fn, args = _named(call)
                    decorators[fn.text.decode()] = _named(args)
                else:
                    decorators[call.text.decode()] = []
            continue
        kind = {
            "parameter_declaration": "param",
            "variable_declaration": "var",
            "resource_declaration": "resource",
            "module_declaration": "module",
            "output_declaration": "output",
        }.get(node.type)
        if kind is None:
            decorators = {}
            continue
        parts = _named(node)
        decl = Decl(kind, parts[0].text.decode(), node, decorators)
        decorators = {}
        if kind in ("resource", "module"):
            decl.type = string_value(parts[1])
            body = parts[-1]
            if body.type == "for_statement":
                head, items, body = _named(body)
                if head.type == "for_loop_parameters":
                    names = [c.text.decode() for c in _named(head)]
                    decl.loop = (names[0], names[1] if len(names) > 1 else None, items)
                else:
                    decl.loop = (head.text.decode(), None, items)
            if body.type == "if_statement":
                decl.condition, body = _named(body)
            decl.body = body
        elif kind in ("param", "output"):
            decl.type = parts[1].text.decode()
            decl.body = parts[2] if len(parts) > 2 else None
        else:
            decl.body = parts[1]
        (outputs if kind == "output" else decls)[decl.name] = decl
    return Template(path, source, tree, decls, outputs)


def string_value_part(child) -> str:
    """The text of one literal part of a string (its content or an escape sequence)."""
    if child.type == "escape_sequence":
        text = child.text.decode()
        return {"\\'": "'", "\\\\": "\\", "\\n": "\n", "\\t": "\t", "\\$": "$"}.get(text, text)
    return child.text.decode()


def string_value(node) -> str | Symbolic:
    parts = []
    for child in _named(node):
        if child.type in ("string_content", "escape_sequence"):
            parts.append(string_value_part(child))
        else:  # an interpolation
            return Symbolic(node.text.decode())
    return "".join(parts)


class Evaluator:
    """Evaluates Bicep expressions of one template. ``env`` gives parameter values; a parameter
    missing there takes its default. Anything that needs Azure stays Symbolic."""

    def __init__(self, template: Template, locals_: dict | None = None, **env):
        self.t = template
        self.env = env
        self.locals = locals_ or {}  # loop variables

    def with_locals(self, **names) -> Evaluator:
        return Evaluator(self.t, {**self.locals, **names}, **self.env)

    def _call_lambda(self, node, *values):
        """A ``lambda_expression`` node (``v => body``) applied to ``values``."""
        *params, body = _named(node)
        assert len(params) == len(values), node.text
        return self.with_locals(**{p.text.decode(): v for p, v in zip(params, values, strict=True)}).eval(body)

    def __call__(self, node):
        return self.eval(node)

    def param(self, name: str):
        if name in self.env:
            return self.env[name]
        decl = self.t.decls[name]
        return self.eval(decl.body) if decl.body is not None else Symbolic(name)

    def eval(self, node):
        kind = node.type
        if kind == "string":
            value = string_value(node)
            if isinstance(value, Symbolic):  # an interpolation: its value when every part is known
                parts = [
                    self.eval(_named(c)[0]) if c.type == "interpolation" else string_value_part(c) for c in _named(node)
                ]
                if not any(isinstance(p, (Symbolic, dict, list)) for p in parts):
                    return "".join(str(p).lower() if isinstance(p, bool) else str(p) for p in parts)
            return value
        if kind == "number":
            return int(node.text.decode())
        if kind == "boolean":
            return node.text.decode() == "true"
        if kind == "null":
            return None
        if kind == "array":
            return [self.eval(item) for item in _named(node)]
        if kind == "object":
            result = {}
            for prop in _named(node):
                if prop.type != "object_property":
                    continue
                parts = _named(prop)
                key = parts[0]
                name = key.text.decode() if key.type == "identifier" else string_value(key)
                result[name] = self.eval(parts[-1]) if len(parts) > 1 else None
            return result
        if kind == "parenthesized_expression":
            return self.eval(_named(node)[0])
        if kind == "subscript_expression":  # `appTables[i]`: one instance of a looped resource
            base, index = _named(node)
            value = self.eval(index)
            if base.type == "identifier" and isinstance(value, int):
                return Symbolic(f"{base.text.decode()}[{value}]")
            return Symbolic(node.text.decode())
        if kind == "identifier":
            name = node.text.decode()
            if name in self.locals:
                return self.locals[name]
            decl = self.t.decls.get(name)
            if decl is None:
                return Symbolic(name)
            if decl.kind == "var":
                return self.eval(decl.body)
            if decl.kind == "param":
                return self.param(name)
            return Symbolic(name)  # a resource or module symbol
        if kind == "unary_expression":
            operand = self.eval(_named(node)[0])
            if node.children[0].type == "!":
                return not self._truth(operand)
            return Symbolic(node.text.decode())
        if kind == "binary_expression":
            left, right = (self.eval(n) for n in _named(node))
            op = next(c.type for c in node.children if not c.is_named)
            if isinstance(left, Symbolic) or isinstance(right, Symbolic):
                return Symbolic(node.text.decode())
            return {
                "==": lambda: left == right,
                "!=": lambda: left != right,
                "&&": lambda: left and right,
                "||": lambda: left or right,
                "<": lambda: left < right,
                ">": lambda: left > right,
                "+": lambda: left + right,
                "-": lambda: left - right,
                "*": lambda: left * right,
                "/": lambda: left // right,  # Bicep divides integers to an integer
            }.get(op, lambda: Symbolic(node.text.decode()))()
        if kind == "ternary_expression":
            cond, then, other = _named(node)
            test = self.eval(cond)
            return self.eval(then) if self._truth(test) else self.eval(other)
        if kind == "call_expression":
            fn, args = _named(node)
            if fn.type != "identifier":  # a method call such as environment().suffixes or x.list()
                return Symbolic(node.text.decode())
            name, arg_nodes = fn.text.decode(), _named(args)
            if name == "mapValues":
                mapped = self.eval(arg_nodes[0])
                if isinstance(mapped, dict) and arg_nodes[1].type == "lambda_expression":
                    return {k: self._call_lambda(arg_nodes[1], v) for k, v in mapped.items()}
                return Symbolic(node.text.decode())
            values = [self.eval(a) for a in arg_nodes]
            if any(isinstance(v, Symbolic) for v in values) and name not in ("concat", "union", "string"):
                return Symbolic(node.text.decode())
            if name == "concat" and all(isinstance(v, list) for v in values):
                return [x for v in values for x in v]
            if name == "union" and all(isinstance(v, dict) for v in values):
                return {k: x for v in values for k, x in v.items()}
            if name == "length" and (isinstance(values[0], (list, dict)) or type(values[0]) is str):
                return len(values[0])
            if name == "range" and all(type(v) is int for v in values):
                return list(range(values[0], values[0] + values[1]))
            if name == "empty" and not any(isinstance(v, Symbolic) for v in values):
                return not values[0]
            if name == "fail" and values and not isinstance(values[0], Symbolic):
                raise DeploymentFails(values[0])
            if name == "string" and not isinstance(values[0], Symbolic):
                if isinstance(values[0], (dict, list)):  # ARM writes an object or array as JSON
                    return json.dumps(values[0], separators=(",", ":"))
                return str(values[0]).lower() if isinstance(values[0], bool) else str(values[0])
            if name == "objectKeys" and isinstance(values[0], dict):
                return list(values[0])
            if name == "intersection" and all(isinstance(v, list) for v in values):
                return [x for x in values[0] if all(x in v for v in values[1:])]
            if name == "join" and isinstance(values[0], list) and all(type(x) is str for x in values[0]):
                return values[1].join(values[0])
            if name in ("max", "min") and all(type(v) is int for v in values):
                return (max if name == "max" else min)(values)
            return Symbolic(node.text.decode())
        return Symbolic(node.text.decode())

    @staticmethod
    def _truth(value) -> bool:
        assert not isinstance(value, Symbolic), f"condition depends on a deployment value: {value}"
        return bool(value)


# ---------------------------------------------------------------------------------------------
# The deployment as a whole
# ---------------------------------------------------------------------------------------------


class Infra:
    """azure.yaml, infra/main.parameters.json and every infra/*.bicep, from ``files`` (relative
    path -> bytes), so tests can check deliberately broken copies."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.templates = {p: load_template(p, s) for p, s in files.items() if p.endswith(".bicep")}

    @classmethod
    def from_disk(cls) -> Infra:
        files = {str(p.relative_to(ROOT)): p.read_bytes() for p in sorted(INFRA.rglob("*.bicep"))}
        for extra in (
            "azure.yaml",
            "README.md",
            "infra/main.parameters.json",
            "host.json",
            "docs/scaling.md",
            "docs/benchmarks.md",
            "docs/deploy.md",
            "docs/production.md",
            "function_app.py",
        ):
            files[extra] = (ROOT / extra).read_bytes()
        return cls(files)

    def broken(self, path: str, old: str, new: str) -> Infra:
        text = self.files[path].decode()
        assert text.count(old) == 1, f"mutation target must occur once in {path}: {old!r}"
        return Infra({**self.files, path: text.replace(old, new).encode()})

    @property
    def scaling_doc(self) -> str:
        return self.files["docs/scaling.md"].decode()

    @property
    def main(self) -> Template:
        return self.templates["infra/main.bicep"]

    @property
    def resources(self) -> Template:
        return self.templates["infra/resources.bicep"]

    def main_defaults(self) -> dict:
        ev = Evaluator(self.main)
        return {n: ev.param(n) for n in self.main.of("param")}

    def module_env(self, **overrides) -> dict:
        """The parameters main.bicep passes to resources.bicep, main's defaults filled in. In openAI
        mode a stand-in key is given unless the caller gives one (main.bicep refuses an empty key)."""
        if overrides.get("upstream") == "openAI":
            overrides.setdefault("openAiApiKey", "sk-stand-in")
        module = self.main.of("module")["app"]
        params = Evaluator(self.main, **overrides).eval(module.body)["params"]
        assert module.type == "resources.bicep"
        return params

    @property
    def settings_module(self) -> Template:
        return self.templates["infra/app-settings.bicep"]

    def settings_layers(self, upstream: str, **overrides) -> dict:
        """The parameters resources.bicep passes to app-settings.bicep: the layers of the app settings."""
        (decl,) = [d for d in self.resources.of("module").values() if d.type == "app-settings.bicep"]
        return self.instances(decl, upstream, **overrides)[0]["params"]

    def app_settings(self, upstream: str, current: dict | None = None, **overrides) -> dict:
        """The app settings a deployment writes, {name: value}, onto a site whose settings are
        ``current`` (none: a first deployment)."""
        layers = self.settings_layers(upstream, **overrides)
        assert "list(" in str(layers["currentAppSettings"]), layers["currentAppSettings"]
        env = {**layers, "currentAppSettings": dict(current or {})}
        (config,) = [
            d
            for d in self.settings_module.of("resource").values()
            if d.type.split("@")[0] == "Microsoft.Web/sites/config"
        ]
        body = Evaluator(self.settings_module, **env).eval(config.body)
        assert body["name"] == "appsettings", body["name"]
        settings = body["properties"]
        assert isinstance(settings, dict), settings
        return settings

    def one(self, type_prefix: str) -> Decl:
        found = self.resources.resources(type_prefix)
        assert len(found) == 1, f"expected one {type_prefix}, found {[d.name for d in found]}"
        return found[0]

    def body(self, decl: Decl, upstream: str = "azureOpenAI", **overrides) -> dict:
        """A resource's body as deployed by main.bicep with its defaults (and ``upstream``)."""
        return Evaluator(self.resources, **self.module_env(upstream=upstream, **overrides)).eval(decl.body)

    def instances(
        self, decl: Decl, upstream: str = "azureOpenAI", deployed_only: bool = True, **overrides
    ) -> list[dict]:
        """Each instance of a resources.bicep declaration (one, or one per loop item), evaluated with
        main.bicep's defaults, ``upstream`` and ``overrides``; with ``deployed_only``, none whose
        condition is false."""
        ev = Evaluator(self.resources, **self.module_env(upstream=upstream, **overrides))
        if decl.loop:
            item, index, items = decl.loop
            values = ev.eval(items)
            assert isinstance(values, list), f"{decl.name}: loop over {values}"
            scopes = [ev.with_locals(**{item: v, **({index: i} if index else {})}) for i, v in enumerate(values)]
        else:
            scopes = [ev]
        return [
            scope.eval(decl.body)
            for scope in scopes
            if not deployed_only or decl.condition is None or Evaluator._truth(scope.eval(decl.condition))
        ]

    def role_assignments(self, upstream: str = "azureOpenAI", deployed_only: bool = False, **overrides) -> list[dict]:
        """Every role assignment (each loop instance apart): its scope symbol, role id, principal
        source text, condition; with ``deployed_only``, those deployed with these parameters."""
        return [
            self._role_assignment(decl, body)
            for decl in self.resources.resources("Microsoft.Authorization/roleAssignments")
            for body in self.instances(decl, upstream, deployed_only=deployed_only, **overrides)
        ]

    def _role_assignment(self, decl: Decl, body: dict) -> dict:
        props = body["properties"]
        role = props["roleDefinitionId"]
        m = re.fullmatch(r"subscriptionResourceId\('Microsoft\.Authorization/roleDefinitions', (\w+)\)", str(role))
        assert m, f"{decl.name}: roleDefinitionId must be subscriptionResourceId(...): {role}"
        role_id = (
            Evaluator(self.resources).eval(self.resources.decls[m.group(1)].body)
            if m.group(1) in self.resources.decls
            else m.group(1)
        )
        return {
            "name": decl.name,
            "scope": str(body.get("scope")),
            "role": role_id,
            "principal": str(props["principalId"]),
            "principalType": props.get("principalType"),
            "condition": decl.condition.text.decode() if decl.condition else None,
        }


def _has_role(infra: Infra, scope: str, role: str, principal: str = "identity.properties.principalId") -> dict:
    for ra in infra.role_assignments():
        if ra["scope"] == scope and ra["role"] == role and ra["principal"] == principal:
            return ra
    raise AssertionError(f"no role assignment {role} on {scope} for {principal}: {infra.role_assignments()}")


def _host_timeout_seconds(infra: Infra) -> int:
    value = json.loads(infra.files["host.json"])["functionTimeout"]
    h, m, s = (int(x) for x in value.split(":"))
    return h * 3600 + m * 60 + s


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def check_parses(infra: Infra) -> None:
    assert infra.templates, "no .bicep files under infra/"
    for path, t in infra.templates.items():
        errors = parse_errors(t.tree)
        assert not errors, f"{path} does not parse: {errors[:5]}"


def check_no_key_based_storage(infra: Infra) -> None:
    storage = infra.one("Microsoft.Storage/storageAccounts")
    props = infra.body(storage)["properties"]
    assert props.get("allowSharedKeyAccess") is False, "storage must refuse shared keys"
    for path, t in infra.templates.items():
        code = t.code
        assert not re.search(r"\blist(Keys|AccountSas|ServiceSas)\s*\(|\.listKeys\s*\(", code), (
            f"{path} reads storage keys"
        )
        assert "AccountKey" not in code, f"{path} builds an AccountKey connection string"
    for mode in MODES:
        settings = infra.app_settings(mode)
        assert settings.get("AzureWebJobsStorage__accountName") == "storage.name", settings
        assert settings.get("AzureWebJobsStorage__credential") == "managedidentity", "host storage via identity"
        assert settings.get("AzureWebJobsStorage__clientId") == "identity.properties.clientId"
        assert "AzureWebJobsStorage" not in settings, "a connection-string AzureWebJobsStorage"
    deployment = infra.body(infra.one("Microsoft.Web/sites"))["properties"]["functionAppConfig"]["deployment"]
    storage_cfg = deployment["storage"]
    assert storage_cfg["type"] == "blobContainer"
    assert storage_cfg["authentication"] == {
        "type": "UserAssignedIdentity",
        "userAssignedIdentityResourceId": "identity.id",
    }, storage_cfg


def check_blob_owner_role(infra: Infra) -> None:
    ra = _has_role(infra, "storage", STORAGE_BLOB_DATA_OWNER)
    assert ra["condition"] is None, "the storage role must always be assigned"


def check_https_and_tls(infra: Infra) -> None:
    site = infra.body(infra.one("Microsoft.Web/sites"))["properties"]
    assert site.get("httpsOnly") is True, "httpsOnly"
    assert site["siteConfig"].get("minTlsVersion") == "1.2", "minTlsVersion"
    storage = infra.body(infra.one("Microsoft.Storage/storageAccounts"))["properties"]
    assert storage.get("minimumTlsVersion") == "TLS1_2", "storage minimumTlsVersion"
    assert storage.get("supportsHttpsTrafficOnly") is True, "storage HTTPS only"
    policies = {
        d.name: infra.body(d)
        for d in infra.resources.resources("Microsoft.Web/sites/basicPublishingCredentialsPolicies")
    }
    assert {p["name"]: p["properties"]["allow"] for p in policies.values()} == {"ftp": False, "scm": False}


SECRET_NAME = re.compile(r"secret|password|connection_?string|api_?key|access_?key|account_?key|sas", re.I)
SECRET_EXPR = re.compile(
    r"\blist\w*\s*\(|\.list\w*\s*\(|ConnectionString|InstrumentationKey|secretUri|"
    r"\bvalue\b|primaryKey|secondaryKey",
    re.I,
)


def check_no_secrets_in_outputs(infra: Infra) -> None:
    for path, t in infra.templates.items():
        secure = {n for n, d in t.of("param").items() if "secure" in d.decorators}
        for name, out in t.outputs.items():
            expr = out.body.text.decode()
            assert not SECRET_NAME.search(name), f"{path}: output {name} is named like a secret"
            assert not SECRET_EXPR.search(expr), f"{path}: output {name} exposes {expr}"
            used = set(re.findall(r"\b\w+\b", expr))
            assert not used & secure, f"{path}: output {name} uses a @secure() parameter"
            assert "secure" not in out.decorators


def check_azure_openai_keyless(infra: Infra) -> None:
    account = infra.one("Microsoft.CognitiveServices/accounts")
    assert account.condition is not None and account.condition.text.decode() == "(useAzureOpenAI)"
    props = infra.body(account)["properties"]
    assert props.get("disableLocalAuth") is True, "the Azure OpenAI account must refuse API keys"
    assert props.get("customSubDomainName"), "Entra auth needs a custom subdomain"
    deployment = infra.body(infra.one("Microsoft.CognitiveServices/accounts/deployments"))
    assert deployment["sku"]["capacity"] == infra.main_defaults()["deploymentCapacity"]
    assert deployment["properties"]["model"]["name"] == infra.main_defaults()["modelName"]
    ra = _has_role(infra, "openAi", COGNITIVE_SERVICES_OPENAI_USER)
    assert ra["condition"] == "(useAzureOpenAI)"
    settings = infra.app_settings("azureOpenAI")
    assert settings.get("AZURE_OPENAI_ENDPOINT") == "openAi.properties.endpoint", settings
    assert settings.get("AZURE_OPENAI_DEPLOYMENT") == infra.main_defaults()["modelName"], settings
    assert settings.get("AZURE_CLIENT_ID") == "identity.properties.clientId", (
        "AZURE_CLIENT_ID makes DefaultAzureCredential use the user-assigned identity"
    )
    assert settings.get("OPENAI_API_KEY") == "" and settings.get("AZURE_OPENAI_API_KEY") == "", (
        "no key in azureOpenAI mode (written empty, which the app reads as unset, so that nothing of the other "
        "mode is left behind)"
    )


def check_key_vault_mode(infra: Infra) -> None:
    vault = infra.one("Microsoft.KeyVault/vaults")
    assert vault.condition is not None and vault.condition.text.decode() == "(useKeyVault)"
    assert infra.body(vault)["properties"].get("enableRbacAuthorization") is True
    ra = _has_role(infra, "keyVault", KEY_VAULT_SECRETS_USER)
    assert ra["condition"] == "(useKeyVault)"
    site = infra.body(infra.one("Microsoft.Web/sites"))
    assert site["properties"].get("keyVaultReferenceIdentity") == "identity.id", (
        "Key Vault references must resolve with the user-assigned identity"
    )
    settings = infra.app_settings("openAI")
    assert (
        settings.get("OPENAI_API_KEY")
        == "'@Microsoft.KeyVault(SecretUri=${keyVault.properties.vaultUri}secrets/${openAiKeySecretName})'"
    ), settings
    assert settings.get("OPENAI_BASE_URL") == ""
    assert infra.app_settings("openAI", openAiBaseUrl="http://x/v1").get("OPENAI_BASE_URL") == "http://x/v1"
    assert settings.get("AZURE_OPENAI_ENDPOINT") == "" and settings.get("AZURE_OPENAI_DEPLOYMENT") == ""
    for t in (infra.main, infra.resources):
        assert "openAiApiKey" in t.decls and "secure" in t.decls["openAiApiKey"].decorators, (
            f"{t.path}: openAiApiKey must be @secure()"
        )


def check_key_vault_secret_kept(infra: Infra) -> None:
    """The deployment writes the key's secret only when it is given the key (azd OPENAI_API_KEY);
    with OPENAI_API_KEY_IN_VAULT and no key it keeps the vault and its versionless reference and
    writes no secret, so a rotation done in the vault survives the next `azd up`."""
    assert infra.main_defaults()["openAiKeyInVault"] is False
    assert _azd_value(infra, "openAiKeyInVault") == "${OPENAI_API_KEY_IN_VAULT=false}"
    secret, vault = infra.one("Microsoft.KeyVault/vaults/secrets"), infra.one("Microsoft.KeyVault/vaults")
    assert infra.instances(secret, "openAI"), "the key given is written"
    kept = {"upstream": "openAI", "openAiApiKey": "", "openAiKeyInVault": True}
    assert infra.instances(vault, **kept), "the vault stays when the key is kept in it"
    assert not infra.instances(secret, **kept), "a deployment given no key rewrites the secret"
    reference = infra.app_settings(**kept)["OPENAI_API_KEY"]
    assert "secretUri" not in reference and "secrets/${openAiKeySecretName}" in reference, (
        f"the reference must be versionless and not need the secret resource: {reference}"
    )
    assert infra.body(secret, "openAI")["name"] == Evaluator(infra.resources).eval(
        infra.resources.decls["openAiKeySecretName"].body
    )
    (settings_module,) = [d for d in infra.resources.of("module").values() if d.type == "app-settings.bicep"]
    assert "openAiKeySecret" in settings_module.body.text.decode().split("dependsOn")[-1], (
        "the settings name the secret: written after it"
    )


def check_api_version(infra: Infra) -> None:
    """Azure OpenAI's GA v1 API by default, in the template as in the app: no api-version (empty in
    the template and azd, unset in the app), which the app calls as /openai/v1. deploy.md says so."""
    from chatstream.settings import Settings
    from chatstream.upstreams.config import entries

    version = infra.main_defaults()["azureOpenAiApiVersion"]
    assert version == "", f"azureOpenAiApiVersion defaults to {version!r}: the GA v1 API needs none"
    assert Settings.model_fields["azure_openai_api_version"].default is None
    assert Settings.from_env({"AZURE_OPENAI_API_VERSION": version}).azure_openai_api_version is None
    azure = {"AZURE_OPENAI_ENDPOINT": "https://x.openai.azure.com", "AZURE_OPENAI_DEPLOYMENT": "gpt-4o"}
    (entry,) = entries(Settings.from_env({**azure, "AZURE_OPENAI_API_VERSION": version}), {})
    assert not entry.dated, "no api-version must mean the v1 API"
    assert _azd_value(infra, "azureOpenAiApiVersion") == "${AZURE_OPENAI_API_VERSION}"
    assert infra.app_settings("azureOpenAI").get("AZURE_OPENAI_API_VERSION") == version
    row = next(
        r for r in _table(infra.files["docs/deploy.md"].decode(), "azd value") if "API_VERSION" in r["azd value"]
    )
    assert "GA v1 API" in row["default"] and "preview" not in row["meaning"], row


def check_openai_key_required(infra: Infra) -> None:
    """openAI mode against api.openai.com without a key stops the deployment with a message that says
    what to set; the default mode never needs one."""
    try:
        infra.module_env(upstream="openAI", openAiApiKey="")
        raise AssertionError("openAI mode with an empty key deploys")
    except DeploymentFails as refused:
        assert "OPENAI_API_KEY" in str(refused) and "azd env set" in str(refused), refused
        assert "OPENAI_BASE_URL" in str(refused), "the message names the keyless alternative"
    assert infra.module_env(upstream="openAI", openAiApiKey="sk-x")["openAiApiKey"] == "sk-x"
    assert infra.module_env(upstream="azureOpenAI", openAiApiKey="")["openAiApiKey"] == ""
    values = json.loads(infra.files["infra/main.parameters.json"])["parameters"]
    assert values["openAiApiKey"]["value"] == "${OPENAI_API_KEY}", values.get("openAiApiKey")


def check_flex_consumption_python(infra: Infra) -> None:
    plan = infra.body(infra.one("Microsoft.Web/serverfarms"))
    assert plan["sku"] == {"name": "FC1", "tier": "FlexConsumption"}, plan["sku"]
    assert plan["properties"].get("reserved") is True, "Linux plan"
    site = infra.body(infra.one("Microsoft.Web/sites"))
    assert site["kind"] == "functionapp,linux"
    assert site["properties"]["serverFarmId"] == "plan.id"
    runtime = site["properties"]["functionAppConfig"]["runtime"]
    assert runtime == {"name": "python", "version": "3.13"}, f"Python 3.13 on Flex Consumption: {runtime}"
    assert site["identity"]["type"] == "UserAssigned"
    assert list(site["identity"]["userAssignedIdentities"]) == ["'${identity.id}'"]
    for mode in MODES:  # settings Flex Consumption rejects or ignores (runtime lives in functionAppConfig)
        settings = {name.upper() for name in infra.app_settings(mode)}
        for name in FLEX_DEPRECATED_SETTINGS:
            assert name not in settings, f"{name} is not valid on Flex Consumption (app settings reference)"
        props = infra.body(infra.one("Microsoft.Web/sites"), mode)["properties"]
        for where, values in (("properties", props), ("siteConfig", props.get("siteConfig", {}))):
            present = {k.lower() for k in values}
            for name in FLEX_DEPRECATED_PROPERTIES:
                assert name.lower() not in present, f"{where}.{name} is deprecated on Flex Consumption"


def check_app_insights_identity(infra: Infra) -> None:
    appi = infra.body(infra.one("Microsoft.Insights/components"))["properties"]
    assert appi.get("DisableLocalAuth") is True, "Application Insights must take Entra-authenticated telemetry only"
    assert appi.get("WorkspaceResourceId") == "logAnalytics.id", "workspace-based (Log Analytics)"
    infra.one("Microsoft.OperationalInsights/workspaces")
    _has_role(infra, "appInsights", MONITORING_METRICS_PUBLISHER)
    for mode in MODES:
        settings = infra.app_settings(mode)
        assert settings.get("APPLICATIONINSIGHTS_CONNECTION_STRING") == "appInsights.properties.ConnectionString"
        assert (
            settings.get("APPLICATIONINSIGHTS_AUTHENTICATION_STRING")
            == "'ClientId=${identity.properties.clientId};Authorization=AAD'"
        ), "App Insights via the identity"
        assert settings.get("PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY") == "true"
        assert settings.get("OTEL_TRACES_SAMPLER") == "always_on", "every stream's span is kept"


def check_time_limits(infra: Infra) -> None:
    """The app's limits are set explicitly, pass the app's own validation, and end before the
    host's functionTimeout; the heartbeat beats Azure's idle cut-off."""
    from chatstream.settings import Settings

    function_timeout = _host_timeout_seconds(infra)
    params = infra.main.of("param")
    for name in ("totalTimeoutSeconds", "firstTokenTimeoutSeconds", "idleTimeoutSeconds"):
        (top,) = params[name].decorators["maxValue"]
        assert int(top.text) < function_timeout, f"{name} may reach functionTimeout"
    (beat,) = params["heartbeatSeconds"].decorators["maxValue"]
    assert int(beat.text) < AZURE_FRONT_END_IDLE_SECONDS, "a heartbeat may come too late for Azure's front end"
    defaults = infra.main_defaults()
    assert defaults["totalTimeoutSeconds"] < function_timeout, "TOTAL_TIMEOUT_SECONDS reaches functionTimeout"
    assert defaults["firstTokenTimeoutSeconds"] <= defaults["totalTimeoutSeconds"]
    for mode in MODES:
        settings = infra.app_settings(mode)
        for name in (
            "UPSTREAM_CONNECT_TIMEOUT_SECONDS",
            "FIRST_TOKEN_TIMEOUT_SECONDS",
            "IDLE_TIMEOUT_SECONDS",
            "TOTAL_TIMEOUT_SECONDS",
            "HEARTBEAT_SECONDS",
            "USAGE_WAIT_SECONDS",
            "UPSTREAM_MAX_RETRIES",
        ):
            assert name in settings, f"{name} must be set explicitly"
        assert settings["TOTAL_TIMEOUT_SECONDS"] == str(defaults["totalTimeoutSeconds"])
        # Values only Azure knows get a stand-in of the right shape; then the app's own validation.
        stand_ins = {
            "AZURE_OPENAI_ENDPOINT": "https://oai-example.openai.azure.com/",
            "OPENAI_API_KEY": "sk-resolved-from-key-vault",
        }
        concrete = {
            k: stand_ins[k] if isinstance(v, Symbolic) else v
            for k, v in settings.items()
            if not isinstance(v, Symbolic) or k in stand_ins
        }
        parsed = Settings.from_env(concrete)
        assert parsed.upstream_kind == {"azureOpenAI": "azure", "openAI": "openai"}[mode]
        assert parsed.default_model == defaults["modelName"]
        assert parsed.total_timeout < function_timeout
        assert parsed.first_token_timeout <= parsed.total_timeout
        assert parsed.heartbeat < AZURE_FRONT_END_IDLE_SECONDS


def check_parameters(infra: Infra) -> None:
    params = infra.main.of("param")
    for name in ("location", "modelName", "deploymentCapacity", "upstream", "openAiLocation"):
        assert name in params, f"main.bicep lacks parameter {name}"
    (allowed,) = params["upstream"].decorators["allowed"]
    assert Evaluator(infra.main).eval(allowed) == list(MODES)
    assert infra.main.decls["location"].body is None, "region is chosen at deployment (azd asks)"
    scopes = [n for n in _named(infra.main.tree.root_node) if n.type == "target_scope_assignment"]
    assert [string_value(_named(n)[0]) for n in scopes] == ["subscription"], "main.bicep creates the resource group"
    values = json.loads(infra.files["infra/main.parameters.json"])["parameters"]
    unknown = set(values) - set(params)
    assert not unknown, f"main.parameters.json sets unknown parameters {unknown}"
    assert values["environmentName"]["value"] == "${AZURE_ENV_NAME}"
    assert values["location"]["value"] == "${AZURE_LOCATION}"
    # An azd default is the Bicep default: `azd up` and `az deployment` deploy the same template.
    defaults = infra.main_defaults()
    for name, entry in values.items():
        m = re.fullmatch(r"\$\{(\w+)=(.*)\}", str(entry["value"]))
        if m:
            want = defaults[name]
            assert m.group(2) == (str(want).lower() if isinstance(want, bool) else str(want)), (
                f"main.parameters.json gives {name} the azd default {m.group(2)!r}; main.bicep's is {want!r}"
            )
    # Every module parameter is declared in resources.bicep and every required one is passed.
    passed = set(infra.module_env())
    declared = infra.resources.of("param")
    assert passed <= set(declared), passed - set(declared)
    required = {n for n, d in declared.items() if d.body is None}
    assert required <= passed, f"resources.bicep parameters not passed: {required - passed}"


def check_scaling_defaults(infra: Infra) -> None:
    """docs/scaling.md's generated section is what tools/bench/scaling.py computes from the benchmark
    figures of record (docs/benchmarks.md), for one worker per instance as Flex runs it; infra's
    instance size and per-instance concurrency are the defaults it states."""
    import sys

    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import scaling

    section, computed = scaling.table(scaling.summary_from_benchmarks(infra.files["docs/benchmarks.md"].decode()))
    assert scaling.section_in(infra.scaling_doc) == section, (
        "docs/scaling.md's generated section is not what tools/bench/scaling.py computes from docs/benchmarks.md"
    )
    assert scaling.WORKERS_PER_INSTANCE == 1, "Flex Consumption runs one Python worker per instance"
    expected = scaling.defaults_from_text(infra.scaling_doc)
    assert expected == computed, (expected, computed)
    assert set(expected) == {"instanceMemoryMB", "httpPerInstanceConcurrency"}, expected
    defaults = infra.main_defaults()
    assert defaults["instanceMemoryMB"] == expected["instanceMemoryMB"], (defaults["instanceMemoryMB"], expected)
    assert defaults["httpPerInstanceConcurrency"] == expected["httpPerInstanceConcurrency"], (
        f"httpPerInstanceConcurrency {defaults['httpPerInstanceConcurrency']} is not docs/scaling.md's {expected}"
    )
    assert "workerProcessCount" not in infra.main.of("param"), "no worker-process parameter on Flex Consumption"
    site = infra.body(infra.one("Microsoft.Web/sites"))
    scale = site["properties"]["functionAppConfig"]["scaleAndConcurrency"]
    assert scale["instanceMemoryMB"] == expected["instanceMemoryMB"]
    assert scale["triggers"]["http"]["perInstanceConcurrency"] == expected["httpPerInstanceConcurrency"]


def _routes(source: str) -> list[tuple[str, str]]:
    """(route, auth level) of every ``@app.route`` in function_app.py; the app's default applies
    where a route names none."""
    import ast

    tree = ast.parse(source)
    default = "FUNCTION"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "FunctionApp":
            for kw in node.keywords:
                if kw.arg == "http_auth_level":
                    default = kw.value.attr
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "route":
                    kws = {kw.arg: kw.value for kw in dec.keywords}
                    level = kws["auth_level"].attr if "auth_level" in kws else default
                    found.append((kws["route"].value, level))
    return found


def _named_by(cell: str, path: str) -> bool:
    """Whether one of the routes in backticks in ``cell`` (`/api/chat`, `GET /api/playground`,
    `/api/v1/…`, `/api/playground/{file}`) is ``path`` or a prefix of it."""
    for token in re.findall(r"`(?:GET |POST |PUT |PATCH |DELETE )?(/[^`]*)`", cell):
        stem = token.split("{")[0].rstrip("…")
        if path == stem.rstrip("/") or (stem.endswith("/") and path.startswith(stem)):
            return True
    return False


def check_deploy_doc_keys(infra: Infra) -> None:
    """docs/deploy.md's key section has a table of the routes and the key each takes: every route of
    function_app.py is named in the row of its own auth level (the admin routes need the master key,
    the anonymous ones say when they are served), and no sentence claims one key for every route."""
    routes = _routes(infra.files["function_app.py"].decode())
    assert routes and any(level == "FUNCTION" for _, level in routes), routes
    prefix = json.loads(infra.files["host.json"])["extensions"]["http"]["routePrefix"]
    doc = infra.files["docs/deploy.md"].decode()
    section = doc[doc.index("## The function key") :]
    section = section[: section.index("\n## ", 1)]
    assert not re.search(r"every (call|request) needs a key", section, re.I), (
        "docs/deploy.md says every call needs a key, but some routes are anonymous"
    )
    assert not re.search(r"every route\b[^.]*\bauth level `?function`?", section, re.I), (
        "docs/deploy.md says every route has auth level function, but the admin routes are admin and some are anonymous"
    )
    rows = {r["auth level"].strip("`").upper(): r for r in _table(section, "routes")}
    for route, level in routes:
        path = f"/{prefix}/" + re.sub(r"/?\{[^}]*\?\}$", "", route)
        assert level in rows, f"deploy.md's key table has no row for auth level {level.lower()} ({path})"
        assert _named_by(rows[level]["routes"], path), (
            f"deploy.md's key table does not name {path} in its `{level.lower()}` row: {rows[level]['routes']}"
        )
    if "ADMIN" in rows:
        assert "master key" in rows["ADMIN"]["key"], "deploy.md: the admin routes need the master key"
    if "ANONYMOUS" in rows:
        assert "404" in rows["ANONYMOUS"]["key"] and "PLAYGROUND_ENABLED" in rows["ANONYMOUS"]["key"], rows["ANONYMOUS"]


def _azd_value(infra: Infra, param: str) -> str:
    return json.loads(infra.files["infra/main.parameters.json"])["parameters"][param]["value"]


def _private_links(infra: Infra, mode: str, **overrides) -> dict:
    """groupId -> params of each private-link.bicep module deployed in ``mode``."""
    found = {}
    for decl in infra.resources.of("module").values():
        if decl.type == "private-link.bicep":
            for body in infra.instances(decl, mode, **overrides):
                found[body["params"]["groupId"]] = body["params"]
    return found


def check_private_network(infra: Infra) -> None:
    """vnetEnabled (off by default): a virtual network with the app's subnet delegated for Flex
    Consumption, and storage, Azure OpenAI and Key Vault with public access off, each reached through
    a private endpoint with its private DNS zone. Off: public endpoints, identity-only access."""
    assert infra.main_defaults()["vnetEnabled"] is False, "network isolation is off by default"
    assert _azd_value(infra, "vnetEnabled") == "${VNET_ENABLED=false}"
    vnet_decl = infra.one("Microsoft.Network/virtualNetworks")
    site_decl = infra.one("Microsoft.Web/sites")
    services = {
        "storage": infra.one("Microsoft.Storage/storageAccounts"),
        "openAi": infra.one("Microsoft.CognitiveServices/accounts"),
        "keyVault": infra.one("Microsoft.KeyVault/vaults"),
    }
    expected_links = {
        "blob": ("storage.id", "privatelink.blob."),
        "table": ("storage.id", "privatelink.table."),
        "account": ("openAi.id", "privatelink.openai.azure.com"),
        "vault": ("keyVault.id", "privatelink.vaultcore.azure.net"),
    }
    for mode in MODES:
        in_use = ["storage", "openAi" if mode == "azureOpenAI" else "keyVault"]
        # Off: nothing private, every service public (identity-only access is checked elsewhere).
        assert not infra.instances(vnet_decl, mode) and not _private_links(infra, mode)
        assert infra.body(site_decl, mode)["properties"].get("virtualNetworkSubnetId") is None
        for name in in_use:
            assert infra.body(services[name], mode)["properties"]["publicNetworkAccess"] == "Enabled", name
        # On.
        (vnet,) = infra.instances(vnet_decl, mode, vnetEnabled=True)
        subnets = {s["name"]: s["properties"] for s in vnet["properties"]["subnets"]}
        app_subnet = Evaluator(infra.resources).eval(infra.resources.decls["appSubnetName"].body)
        pe_subnet = Evaluator(infra.resources).eval(infra.resources.decls["privateEndpointSubnetName"].body)
        assert [d["properties"]["serviceName"] for d in subnets[app_subnet].get("delegations", [])] == [
            "Microsoft.App/environments"
        ], "Flex Consumption integrates with a subnet delegated to Microsoft.App/environments"
        assert subnets[pe_subnet].get("privateEndpointNetworkPolicies") == "Disabled"
        subnet_ref = infra.body(site_decl, mode, vnetEnabled=True)["properties"].get("virtualNetworkSubnetId")
        assert isinstance(subnet_ref, str) and "subnets/${appSubnetName}" in subnet_ref, subnet_ref
        for name in in_use:
            props = infra.body(services[name], mode, vnetEnabled=True)["properties"]
            assert props["publicNetworkAccess"] == "Disabled", f"{name} stays public with vnetEnabled"
            assert props["networkAcls"]["defaultAction"] == "Deny", name
        links = _private_links(infra, mode, vnetEnabled=True)
        # No queue endpoint: the app and its host use blobs and tables only (HTTP triggers).
        wanted = {"blob", "table", "account" if mode == "azureOpenAI" else "vault"}
        assert set(links) == wanted, (mode, sorted(links))
        for group, params in links.items():
            target, zone = expected_links[group]
            assert params["targetId"] == target, (group, params["targetId"])
            assert zone in params["zoneName"], (group, params["zoneName"])
            assert "privateEndpointSubnetName" in str(params["subnetId"]) and params["virtualNetworkId"] == "vnet.id"
    link = infra.templates["infra/private-link.bicep"]
    kinds = {d.type.split("@")[0]: Evaluator(link).eval(d.body) for d in link.of("resource").values()}
    zone_link = kinds["Microsoft.Network/privateDnsZones/virtualNetworkLinks"]["properties"]
    assert zone_link["registrationEnabled"] is False and zone_link["virtualNetwork"]["id"] == "virtualNetworkId"
    connection = kinds["Microsoft.Network/privateEndpoints"]["properties"]["privateLinkServiceConnections"][0]
    assert connection["properties"] == {"privateLinkServiceId": "targetId", "groupIds": ["groupId"]}, connection
    (config,) = kinds["Microsoft.Network/privateEndpoints/privateDnsZoneGroups"]["properties"]["privateDnsZoneConfigs"]
    assert config["properties"]["privateDnsZoneId"] == "zone.id"
    assert kinds["Microsoft.Network/privateDnsZones"]["name"] == "zoneName"


def check_diagnostics(infra: Infra) -> None:
    """Resource logs and metrics of the Function App, storage (account, blob and table services),
    Azure OpenAI and Key Vault go to the Log Analytics workspace, which takes no keys."""
    workspace = infra.body(infra.one("Microsoft.OperationalInsights/workspaces"))["properties"]
    assert workspace.get("features", {}).get("disableLocalAuth") is True, "Log Analytics with local (key) auth off"
    wanted = {
        "azureOpenAI": {"functionApp", "storage", "blobService", "tableService", "openAi"},
        "openAI": {"functionApp", "storage", "blobService", "tableService", "keyVault"},
    }
    for mode in MODES:
        settings = {}
        for decl in infra.resources.resources("Microsoft.Insights/diagnosticSettings"):
            for body in infra.instances(decl, mode):
                settings[str(body["scope"])] = body["properties"]
        assert set(settings) == wanted[mode], (mode, sorted(settings))
        for scope, props in settings.items():
            assert props["workspaceId"] == "logAnalytics.id", scope
            assert all(m["enabled"] for m in props.get("metrics", [])) and props.get("metrics"), f"{scope}: metrics"
            logs = {
                entry.get("category") or entry.get("categoryGroup")
                for entry in props.get("logs", [])
                if entry["enabled"]
            }
            needed = {
                "functionApp": {"FunctionAppLogs"},
                "storage": set(),
                "blobService": {"StorageWrite", "StorageDelete"},
                "tableService": {"StorageWrite", "StorageDelete"},
                "openAi": {"allLogs"},
                "keyVault": {"allLogs"},
            }[scope]
            assert needed <= logs, (scope, logs)


def check_hardening(infra: Infra) -> None:
    """Key Vault purge protection is a choice (off by default, for `azd down --purge`) with 90 days of
    soft delete; Azure OpenAI makes no outbound calls; deleted blobs and containers are kept a week;
    zone redundancy is a parameter that takes the plan and the storage together."""
    defaults = infra.main_defaults()
    assert defaults["keyVaultPurgeProtection"] is False and defaults["keyVaultSoftDeleteRetentionDays"] == 90
    assert defaults["zoneRedundant"] is False
    assert _azd_value(infra, "keyVaultPurgeProtection") == "${AZURE_KEY_VAULT_PURGE_PROTECTION=false}"
    assert _azd_value(infra, "zoneRedundant") == "${AZURE_ZONE_REDUNDANT=false}"
    assert _azd_value(infra, "keyVaultSoftDeleteRetentionDays") == "${AZURE_KEY_VAULT_SOFT_DELETE_DAYS=90}"
    vault = infra.one("Microsoft.KeyVault/vaults")
    props = infra.body(vault, "openAI")["properties"]
    assert props["softDeleteRetentionInDays"] == 90 and props.get("enablePurgeProtection") is None, props
    assert infra.body(vault, "openAI", keyVaultPurgeProtection=True)["properties"]["enablePurgeProtection"] is True
    oai = infra.body(infra.one("Microsoft.CognitiveServices/accounts"))["properties"]
    assert oai.get("restrictOutboundNetworkAccess") is True and oai.get("allowedFqdnList") == [], oai
    blob = infra.body(infra.one("Microsoft.Storage/storageAccounts/blobServices"))["properties"]
    for policy in ("deleteRetentionPolicy", "containerDeleteRetentionPolicy"):
        assert blob[policy]["enabled"] is True and blob[policy]["days"] >= 1, (policy, blob.get(policy))
    plan, storage = infra.one("Microsoft.Web/serverfarms"), infra.one("Microsoft.Storage/storageAccounts")
    assert infra.body(plan)["properties"].get("zoneRedundant") is False
    assert infra.body(storage)["sku"]["name"] == "Standard_LRS"
    assert infra.body(plan, zoneRedundant=True)["properties"]["zoneRedundant"] is True
    assert infra.body(storage, zoneRedundant=True)["sku"]["name"] == "Standard_ZRS", "zone-redundant plan, ZRS storage"


def check_principal_type(infra: Infra) -> None:
    """The deploying principal's kind is a parameter (User by default, ServicePrincipal for a pipeline),
    mapped for azd, and every role assignment to that principal uses it."""
    (allowed,) = infra.main.of("param")["principalType"].decorators["allowed"]
    assert Evaluator(infra.main).eval(allowed) == ["User", "ServicePrincipal"]
    assert infra.main_defaults()["principalType"] == "User"
    assert _azd_value(infra, "principalType") == "${AZURE_PRINCIPAL_TYPE=User}"
    assert _azd_value(infra, "principalId") == "${AZURE_PRINCIPAL_ID}"
    for mode in MODES:
        for kind in ("User", "ServicePrincipal"):
            ras = infra.role_assignments(mode, deployed_only=True, principalId=DEPLOYER, principalType=kind)
            mine = [ra for ra in ras if ra["principal"] == DEPLOYER]
            assert mine and all(ra["principalType"] == kind for ra in mine), (mode, kind, mine)
            assert all(ra["principalType"] == "ServicePrincipal" for ra in ras if ra["principal"] != DEPLOYER)
        assert not [ra for ra in infra.role_assignments(mode, deployed_only=True) if ra["principal"] == ""], (
            "no role assignment for an empty principalId"
        )


def check_app_state_storage(infra: Infra) -> None:
    """The app's own state: its tables and stream-log container exist in the host's storage account,
    the app identity (and the deployer) get Table Data Contributor on each table and Blob Data
    Contributor on the container, no wider, and the app settings give the service URIs."""
    tables = [b["name"] for b in infra.instances(infra.one("Microsoft.Storage/storageAccounts/tableServices/tables"))]
    assert tables == list(APP_TABLES), tables
    containers = {
        infra.body(d)["name"]: d.name
        for d in infra.resources.resources("Microsoft.Storage/storageAccounts/blobServices/containers")
    }
    assert STREAMS_CONTAINER in containers, containers
    table_decl = infra.one("Microsoft.Storage/storageAccounts/tableServices/tables").name
    table_scopes = {f"{table_decl}[{i}]" for i in range(len(APP_TABLES))}
    for mode in MODES:
        ras = infra.role_assignments(mode, deployed_only=True, principalId=DEPLOYER)
        for principal in ("identity.properties.principalId", DEPLOYER):
            mine = [ra for ra in ras if ra["principal"] == principal]
            tables_granted = {ra["scope"] for ra in mine if ra["role"] == STORAGE_TABLE_DATA_CONTRIBUTOR}
            assert tables_granted == table_scopes, (principal, tables_granted)
            assert {ra["scope"] for ra in mine if ra["role"] == STORAGE_BLOB_DATA_CONTRIBUTOR} == {
                containers[STREAMS_CONTAINER]
            }, principal
        settings = infra.app_settings(mode)
        assert settings.get("AzureWebJobsStorage__tableServiceUri") == "storage.properties.primaryEndpoints.table"
        assert settings.get("AzureWebJobsStorage__blobServiceUri") == "storage.properties.primaryEndpoints.blob"
        assert settings.get("AzureWebJobsStorage__credential") == "managedidentity"
        assert settings.get("AzureWebJobsStorage__clientId") == "identity.properties.clientId"


def check_azure_yaml(infra: Infra) -> None:
    project = yaml.safe_load(infra.files["azure.yaml"])
    assert isinstance(project, dict) and project.get("name")
    services = project["services"]
    assert len(services) == 1, services
    ((name, service),) = services.items()
    assert service.get("host") == "function", f"azd service {name} must deploy to a function app"
    assert service.get("language") in ("python", "py"), f"azd service {name} must be python"
    assert (ROOT / service.get("project", ".") / "function_app.py").exists()
    infra_cfg = project.get("infra", {})
    assert infra_cfg.get("provider", "bicep") == "bicep"
    assert f"{infra_cfg.get('path', 'infra')}/{infra_cfg.get('module', 'main')}.bicep" in infra.templates
    tags = infra.body(infra.one("Microsoft.Web/sites"))["tags"]
    assert tags.get("azd-service-name") == name, f"the function app must be tagged azd-service-name={name}: {tags}"
    # CHAT_APP_SETTINGS is an object parameter: azd reads those from `azd env set` since 1.23.4.
    assert project.get("requiredVersions", {}).get("azd") == ">= 1.23.4", project.get("requiredVersions")


# ---- issue #32: a deployment that stays right after the second `azd up` ----


def _section(text: str, heading: str) -> str:
    """The text under a markdown heading (any level) up to the next heading of that level or higher."""
    m = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert m, f"no heading {heading!r}"
    level = len(m.group(1))
    rest = text[m.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def _table(text: str, first_header: str) -> list[dict]:
    """The rows of the first markdown table in ``text`` whose header starts with ``first_header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].lower() == first_header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, (c.strip() for c in row.strip().strip("|").split("|")), strict=False)))
            return rows
    raise AssertionError(f"no table whose first column is {first_header!r}")


def _date(cell: str) -> datetime.date:
    m = re.search(r"\d{4}-\d{2}-\d{2}", cell)
    assert m, f"no date in {cell!r}"
    return datetime.date.fromisoformat(m.group(0))


def check_model_default(infra: Infra) -> None:
    """The default model version is one Azure still lets a new customer deploy, by the dated table of
    what was checked in docs/deploy.md ("The model"): GA, before the end of new deployments (12
    months after release) and before its retirement, on the day of the check and today. The
    deployment says explicitly when Azure may move it to another version."""
    defaults = infra.main_defaults()
    doc = infra.files["docs/deploy.md"].decode()
    section = _section(doc, "The model")
    checked = _date(re.search(r"[Cc]hecked (\d{4}-\d{2}-\d{2})", section).group(0))
    rows = _table(section, "model")
    row = next(
        (
            r
            for r in rows
            if r["model"].strip("`") == defaults["modelName"] and r["version"] == defaults["modelVersion"]
        ),
        None,
    )
    assert row, (
        f"docs/deploy.md's model table has no row for the default {defaults['modelName']} {defaults['modelVersion']}"
    )
    assert row["lifecycle"] == "GA", row
    until, retires = _date(row["new deployments until"]), _date(row["retirement"])
    assert checked < until and checked < retires, f"the default was already past its dates when checked: {row}"
    today = datetime.date.today()
    assert today < until and today < retires, (
        f"today ({today}) Azure no longer deploys {defaults['modelName']} {defaults['modelVersion']} for new "
        f"customers ({row}): check the retirement schedule again, choose a current default in infra/main.bicep "
        f"and infra/main.parameters.json, and update the table in docs/deploy.md"
    )
    deployment = infra.body(infra.one("Microsoft.CognitiveServices/accounts/deployments"))["properties"]
    (allowed,) = infra.main.of("param")["modelVersionUpgradeOption"].decorators["allowed"]
    assert set(Evaluator(infra.main).eval(allowed)) == {
        "OnceCurrentVersionExpired",
        "OnceNewDefaultVersionAvailable",
        "NoAutoUpgrade",
    }
    assert deployment.get("versionUpgradeOption") == "OnceCurrentVersionExpired", (
        "versionUpgradeOption must be set explicitly (the pinned version until it retires)"
    )
    assert _azd_value(infra, "modelName") == "${CHAT_MODEL=" + defaults["modelName"] + "}"
    assert _azd_value(infra, "modelVersion") == "${AZURE_OPENAI_MODEL_VERSION=" + defaults["modelVersion"] + "}"


def owned_settings(infra: Infra, mode: str = "azureOpenAI") -> dict:
    """The settings the template owns (layer 4): {name: value} in ``mode``."""
    return dict(infra.settings_layers(mode)["templateSettings"])


def check_app_settings_layers(infra: Infra) -> None:
    """The app settings are not declared whole on the site (a second `azd up` would drop what the
    portal set): they are one `appsettings` resource written from layers: the template's defaults,
    then the site's current settings (a portal edit stays), then the operator's CHAT_APP_SETTINGS
    (written again by every `azd up`), then what the template owns. An owned name in
    CHAT_APP_SETTINGS stops the deployment, naming it."""
    for mode in MODES:
        site = infra.body(infra.one("Microsoft.Web/sites"), mode)["properties"]
        assert "appSettings" not in site["siteConfig"], (
            "siteConfig.appSettings replaces every setting on each deployment"
        )
    layers = infra.settings_layers("azureOpenAI")
    current = str(layers["currentAppSettings"])
    assert "list(" in current and "functionApp.id" in current and "/config/appsettings" in current, current
    assert "secure" in infra.settings_module.decls["currentAppSettings"].decorators, (
        "the current settings may hold a key set by hand: a @secure() parameter stays out of the deployment history"
    )
    params = infra.main.of("param")
    assert params["appSettings"].type == "object" and infra.main_defaults()["appSettings"] == {}
    # CHAT_APP_SETTINGS may hold a key (a pool entry's): secure wherever it is a parameter.
    for template, name in (
        (infra.main, "appSettings"),
        (infra.resources, "appSettings"),
        (infra.settings_module, "operatorSettings"),
    ):
        assert "secure" in template.decls[name].decorators, f"{template.path}: {name} must be @secure()"
    assert _azd_value(infra, "appSettings") == "${CHAT_APP_SETTINGS}"
    by_hand = {"PLAYGROUND_ENABLED": "true", "SET_IN_THE_PORTAL": "1", "AZURE_CLIENT_ID": "tampered"}
    kept = infra.app_settings("azureOpenAI", current=by_hand)
    assert kept["PLAYGROUND_ENABLED"] == "true" and kept["SET_IN_THE_PORTAL"] == "1", "a portal edit is kept"
    assert kept["AZURE_CLIENT_ID"] == "identity.properties.clientId", "what the template owns is written again"
    operator = {
        "PLAYGROUND_ENABLED": "false",
        "CALLER_KEYS": "required",
        "UPSTREAMS": [{"name": "a", "base_url": "http://x/v1"}],
    }
    written = infra.app_settings("azureOpenAI", current=by_hand, appSettings=operator)
    assert written["PLAYGROUND_ENABLED"] == "false" and written["CALLER_KEYS"] == "required", "CHAT_APP_SETTINGS wins"
    assert json.loads(written["UPSTREAMS"]) == operator["UPSTREAMS"], "a list is written as its JSON"
    for name in ("TOTAL_TIMEOUT_SECONDS", "AZURE_OPENAI_ENDPOINT", "OPENAI_API_KEY"):
        assert name in owned_settings(infra)
        try:
            infra.app_settings("azureOpenAI", appSettings={"CALLER_KEYS": "required", name: "x"})
            raise AssertionError(f"CHAT_APP_SETTINGS overrides {name}, which the template owns")
        except DeploymentFails as refused:
            assert name in str(refused) and "CALLER_KEYS" not in str(refused), refused


def check_site_update_strategy(infra: Infra) -> None:
    """A deployment restarts the instances with Recreate by default (the app's drain and hand-over
    cover it); RollingUpdate, which Microsoft calls a preview not recommended for production, is the
    choice away from it, by a parameter that azd keeps."""
    (allowed,) = infra.main.of("param")["siteUpdateStrategy"].decorators["allowed"]
    assert set(Evaluator(infra.main).eval(allowed)) == {"RollingUpdate", "Recreate"}
    config = infra.body(infra.one("Microsoft.Web/sites"))["properties"]["functionAppConfig"]
    assert config.get("siteUpdateStrategy") == {"type": "Recreate"}, config.get("siteUpdateStrategy")
    assert _azd_value(infra, "siteUpdateStrategy") == "${AZURE_SITE_UPDATE_STRATEGY=Recreate}"
    rolling = infra.body(infra.one("Microsoft.Web/sites"), siteUpdateStrategy="RollingUpdate")
    assert rolling["properties"]["functionAppConfig"]["siteUpdateStrategy"] == {"type": "RollingUpdate"}


# A typical request's prompt, for the capacity arithmetic (docs/deploy.md, "Capacity").
TYPICAL_PROMPT_TOKENS = 1000
# Requests a minute the default deployment must admit at the default output cap.
MIN_REQUESTS_PER_MINUTE = 30


def _tokens_per_minute(text: str, model: str) -> int:
    m = re.search(r'"model_limits": \{"' + re.escape(model) + r'": \{"tokens_per_minute": (\d+)\}', text)
    assert m, f"no model limit for {model}"
    return int(m.group(1))


def check_capacity(infra: Infra) -> None:
    """Azure OpenAI counts prompt + output cap against the deployment's TPM as a request arrives: the
    default capacity and the default output cap (DEFAULT_MAX_OUTPUT_TOKENS, written by the template)
    admit a realistic rate, docs/deploy.md states that rate from the same figures, and the team
    production.md creates fits in the deployment."""
    capacity = infra.main_defaults()["deploymentCapacity"]
    defaults = infra.settings_layers("azureOpenAI")["templateDefaults"]
    assert "DEFAULT_MAX_OUTPUT_TOKENS" in defaults, "the template must state the output cap it sizes the capacity for"
    cap = int(defaults["DEFAULT_MAX_OUTPUT_TOKENS"])
    per_request = TYPICAL_PROMPT_TOKENS + cap
    rate = capacity * 1000 // per_request
    assert rate >= MIN_REQUESTS_PER_MINUTE, (
        f"{capacity} units admit {rate} requests a minute at a {cap}-token cap (prompt {TYPICAL_PROMPT_TOKENS})"
    )
    section = " ".join(_section(infra.files["docs/deploy.md"].decode(), "Capacity: requests a minute").split())
    stated = f"{capacity} × 1,000 ÷ ({TYPICAL_PROMPT_TOKENS:,} + {cap:,}) = **{rate}**"
    assert stated in section, f"docs/deploy.md's capacity arithmetic must read {stated!r}"
    production = " ".join(infra.files["docs/production.md"].decode().split())  # lines joined
    model = infra.main_defaults()["modelName"]
    team = _tokens_per_minute(production, model)
    assert team <= capacity * 1000, f"production.md's team may use {team} TPM of a {capacity * 1000} TPM deployment"
    assert (
        f"AZURE_OPENAI_DEPLOYMENT_CAPACITY={capacity}" in production and f"about {rate} requests a minute" in production
    )
    assert f"about {team // per_request} requests" in production, "production.md: the team's requests in flight"


def check_outbound_network(infra: Infra) -> None:
    """With vnetEnabled the app subnet leaves through a NAT gateway (a parameter, on by default) whose
    idle timeout outlasts the app's first-token and idle limits; without it, openAI mode against
    api.openai.com is refused at deployment. The platform's own calls for the app (Key Vault
    references) go through the virtual network too."""
    assert infra.main_defaults()["natGateway"] is True
    assert _azd_value(infra, "natGateway") == "${VNET_NAT_GATEWAY=true}"
    nat_decl = infra.one("Microsoft.Network/natGateways")
    ip_decl = infra.one("Microsoft.Network/publicIPAddresses")
    vnet_decl = infra.one("Microsoft.Network/virtualNetworks")
    app_subnet = Evaluator(infra.resources).eval(infra.resources.decls["appSubnetName"].body)
    site_decl = infra.one("Microsoft.Web/sites")
    for mode in MODES:
        assert not infra.instances(nat_decl, mode), "no NAT gateway without the virtual network"
        assert infra.body(site_decl, mode)["properties"].get("outboundVnetRouting") is None
        (nat,) = infra.instances(nat_decl, mode, vnetEnabled=True)
        (ip,) = infra.instances(ip_decl, mode, vnetEnabled=True)
        assert ip["sku"]["name"] == "Standard" and ip["properties"]["publicIPAllocationMethod"] == "Static", ip
        assert nat["properties"]["publicIpAddresses"] == [{"id": "natPublicIp.id"}], nat
        (vnet,) = infra.instances(vnet_decl, mode, vnetEnabled=True)
        subnets = {sn["name"]: sn["properties"] for sn in vnet["properties"]["subnets"]}
        assert subnets[app_subnet].get("natGateway") == {"id": "nat.id"}, subnets[app_subnet]
        routing = infra.body(site_decl, mode, vnetEnabled=True)["properties"].get("outboundVnetRouting")
        assert routing == {"allTraffic": True}, f"Key Vault references through the virtual network: {routing}"
        for first_token, idle in ((120, 60), (1740, 60), (30, 900)):
            (nat,) = infra.instances(
                nat_decl, mode, vnetEnabled=True, firstTokenTimeoutSeconds=first_token, idleTimeoutSeconds=idle
            )
            minutes = nat["properties"]["idleTimeoutInMinutes"]
            assert 4 <= minutes <= 120 and minutes * 60 >= max(first_token, idle), (first_token, idle, minutes)
        assert not infra.instances(
            nat_decl, mode, vnetEnabled=True, natGateway=False, openAiBaseUrl="http://10.0.5.4/v1"
        )
    try:
        infra.module_env(upstream="openAI", vnetEnabled=True, natGateway=False)
        raise AssertionError(
            "vnetEnabled + openAI mode + no NAT gateway deploys an app that cannot reach api.openai.com"
        )
    except DeploymentFails as refused:
        assert "VNET_NAT_GATEWAY" in str(refused) and "OPENAI_BASE_URL" in str(refused), refused
    # A server inside the network needs no way out.
    try:
        infra.module_env(upstream="openAI", vnetEnabled=True, natGateway=False, openAiBaseUrl="http://10.0.5.4:8000/v1")
    except DeploymentFails as refused:
        raise AssertionError(f"a server inside the network is refused without a NAT gateway: {refused}") from None


def check_scale_limits(infra: Infra) -> None:
    """maximumInstanceCount takes what Flex Consumption accepts (1 to 1000: a small cap bounds the
    cost); the sizing and the always-ready instances are azd values, with main.bicep's defaults."""
    param = infra.main.of("param")["maximumInstanceCount"]
    (low,) = param.decorators["minValue"]
    (high,) = param.decorators["maxValue"]
    assert (int(low.text), int(high.text)) == (1, 1000), (low.text, high.text)
    assert 1 <= infra.main_defaults()["maximumInstanceCount"] <= 1000
    for name, azd in (
        ("maximumInstanceCount", "AZURE_MAXIMUM_INSTANCE_COUNT"),
        ("instanceMemoryMB", "AZURE_INSTANCE_MEMORY_MB"),
        ("httpPerInstanceConcurrency", "AZURE_HTTP_PER_INSTANCE_CONCURRENCY"),
        ("alwaysReadyInstances", "AZURE_ALWAYS_READY_INSTANCES"),
    ):
        assert _azd_value(infra, name) == "${" + f"{azd}={infra.main_defaults()[name]}" + "}", name
    site = infra.one("Microsoft.Web/sites")
    scale = infra.body(site)["properties"]["functionAppConfig"]["scaleAndConcurrency"]
    assert scale["alwaysReady"] == [], "no always-ready instance by default"
    scale = infra.body(site, alwaysReadyInstances=2)["properties"]["functionAppConfig"]["scaleAndConcurrency"]
    assert scale["alwaysReady"] == [{"name": "http", "instanceCount": 2}], scale["alwaysReady"]


def check_host_diagnostic_events(infra: Infra) -> None:
    """The host's diagnostic-events table would need a table role on the whole account: the template
    turns the feature off with its documented flag instead (or grants that role)."""
    account_role = [
        ra
        for ra in infra.role_assignments()
        if ra["scope"] == "storage" and ra["role"] == STORAGE_TABLE_DATA_CONTRIBUTOR and "identity" in ra["principal"]
    ]
    for mode in MODES:
        flags = infra.app_settings(mode).get("AzureWebJobsFeatureFlags", "")
        assert "DisableDiagnosticEventLogging" in flags.split(",") or account_role, (
            "the host writes diagnostic events to a table its identity may not create (403s)"
        )


def check_stream_log_lifecycle(infra: Infra) -> None:
    """A lifecycle rule deletes stream logs the app left behind, later than any stream may still be
    resumed (RESUME_TTL_SECONDS at most, after a stream of TOTAL_TIMEOUT_SECONDS at most)."""
    from chatstream.settings import Settings

    policies = [
        infra.body(d) for d in infra.resources.resources("Microsoft.Storage/storageAccounts/managementPolicies")
    ]
    assert len(policies) == 1, f"expected one lifecycle management policy on the storage account, found {len(policies)}"
    (policy,) = policies
    assert policy["name"] == "default", policy["name"]
    rules = [r for r in policy["properties"]["policy"]["rules"] if r["enabled"]]
    rule = next(
        (r for r in rules if f"{STREAMS_CONTAINER}/" in r["definition"]["filters"].get("prefixMatch", [])), None
    )
    assert rule, f"no lifecycle rule on the {STREAMS_CONTAINER} container: {rules}"
    assert "appendBlob" in rule["definition"]["filters"]["blobTypes"], "the stream logs are append blobs"
    days = rule["definition"]["actions"]["baseBlob"]["delete"]["daysAfterModificationGreaterThan"]
    ttl = next(m.le for m in Settings.model_fields["resume_ttl_seconds"].metadata if hasattr(m, "le"))
    (total,) = infra.main.of("param")["totalTimeoutSeconds"].decorators["maxValue"]
    assert days * 86400 > ttl + int(total.text), (days, ttl)


def _scaling_figures(infra: Infra) -> tuple[int, str]:
    """docs/scaling.md's default httpPerInstanceConcurrency and its cost per million typical streams."""
    import sys

    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import scaling

    concurrency = scaling.defaults_from_text(infra.scaling_doc)["httpPerInstanceConcurrency"]
    m = re.search(r"^\| per million streams \(instances kept full\) \| [^|]+ \| (\$[\d.]+) \|", infra.scaling_doc, re.M)
    assert m, "docs/scaling.md has no per-million cost row"
    return concurrency, m.group(1)


def check_deploy_doc_scaling(infra: Infra) -> None:
    """docs/deploy.md states docs/scaling.md's figures: httpPerInstanceConcurrency and the compute
    cost per million typical streams."""
    concurrency, cost = _scaling_figures(infra)
    doc = infra.files["docs/deploy.md"].decode()
    stated = re.findall(r"`httpPerInstanceConcurrency`[^|.\n]*?\((\d+)\)", doc)
    assert stated and set(stated) == {str(concurrency)}, (
        f"deploy.md: httpPerInstanceConcurrency {stated}, scaling.md {concurrency}"
    )
    costs = re.findall(r"(\$[\d.]+) per million typical streams", doc)
    assert costs and set(costs) == {cost}, f"deploy.md: {costs} per million typical streams, scaling.md {cost}"


def check_keyless_compatible_server(infra: Infra) -> None:
    """openAI mode with OPENAI_BASE_URL deploys without a key (a server inside the network that wants
    none): no vault, no key setting, the base URL set, and the app reads it as its upstream."""
    from chatstream.settings import Settings

    url = "http://10.0.5.4:8000/v1"
    try:
        env = infra.module_env(upstream="openAI", openAiApiKey="", openAiBaseUrl=url)
    except DeploymentFails as refused:
        raise AssertionError(f"a keyless server at OPENAI_BASE_URL is refused: {refused}") from None
    assert env["openAiApiKey"] == ""
    assert not infra.instances(infra.one("Microsoft.KeyVault/vaults"), "openAI", openAiApiKey="", openAiBaseUrl=url)
    settings = infra.app_settings("openAI", openAiApiKey="", openAiBaseUrl=url)
    assert settings["OPENAI_API_KEY"] == "" and settings["OPENAI_BASE_URL"] == url, settings
    concrete = {k: v for k, v in settings.items() if not isinstance(v, Symbolic)}
    parsed = Settings.from_env(concrete)
    assert parsed.upstream_kind == "openai" and parsed.openai_base_url == url and parsed.openai_api_key is None
    # With a key, a compatible server's key is kept in the vault like OpenAI's.
    assert infra.instances(infra.one("Microsoft.KeyVault/vaults"), "openAI", openAiApiKey="k", openAiBaseUrl=url)


CHECKS = [
    check_parses,
    check_no_key_based_storage,
    check_blob_owner_role,
    check_https_and_tls,
    check_no_secrets_in_outputs,
    check_azure_openai_keyless,
    check_key_vault_mode,
    check_openai_key_required,
    check_key_vault_secret_kept,
    check_api_version,
    check_flex_consumption_python,
    check_app_insights_identity,
    check_time_limits,
    check_parameters,
    check_scaling_defaults,
    check_azure_yaml,
    check_deploy_doc_keys,
    check_private_network,
    check_diagnostics,
    check_hardening,
    check_principal_type,
    check_app_state_storage,
    check_model_default,
    check_app_settings_layers,
    check_site_update_strategy,
    check_capacity,
    check_outbound_network,
    check_scale_limits,
    check_host_diagnostic_events,
    check_stream_log_lifecycle,
    check_deploy_doc_scaling,
    check_keyless_compatible_server,
]


@pytest.fixture(scope="module")
def infra() -> Infra:
    return Infra.from_disk()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_template(infra, check):
    check(infra)


# Each entry breaks one fact in a copy of the templates; the named check must then fail.
R, M = "infra/resources.bicep", "infra/main.bicep"


def _measured(path: str, pattern: str) -> str:
    """The text in ``path`` that ``pattern`` finds: the figures a new `make bench` rewrites, so that
    the mutations below follow them (docs/scaling.md, "Re-running")."""
    found = re.search(pattern, (ROOT / path).read_text(encoding="utf-8"), re.M)
    assert found, f"{pattern!r} not in {path}"
    return found.group(0)


_CONCURRENCY = _measured(M, r"^param httpPerInstanceConcurrency int = \d+$")
_HELD = _measured("docs/scaling.md", r"^\| [\d,]+ MB, [^|]+\| typical[^\n]*?\| \*\*\d+\*\* \|")
_SPLIT = _measured("docs/benchmarks.md", r"^\| this app, 1 worker \| [\d.]+ / [\d.]+ \| [\d.]+ / [\d.]+ \|")
# What deploy.md says now (make bench rewrites the figures it follows): each breakage puts an old one.
_DEPLOY_DOC = (ROOT / "docs" / "deploy.md").read_text()
_DEPLOY_CONCURRENCY = re.search(r"`httpPerInstanceConcurrency` \(\d+\)", _DEPLOY_DOC).group(0)
_DEPLOY_COST = re.search(r"\(\$[\d.]+ per million typical streams\)", _DEPLOY_DOC).group(0)

BREAKAGES = [
    ("syntax error", R, "  kind: 'OpenAI'\n", "  kind: 'OpenAI'\n  }}\n", check_parses),
    ("shared keys allowed", R, "allowSharedKeyAccess: false", "allowSharedKeyAccess: true", check_no_key_based_storage),
    (
        "shared-key setting commented out",
        R,
        "    allowSharedKeyAccess: false\n",
        "    // allowSharedKeyAccess: false\n",
        check_no_key_based_storage,
    ),
    (
        "AccountKey connection string",
        R,
        "  AzureWebJobsStorage__accountName: storage.name\n",
        "  AzureWebJobsStorage__accountName: 'DefaultEndpointsProtocol=https;AccountName=${storage.name};AccountKey=${storage.listKeys().keys[0].value}'\n",
        check_no_key_based_storage,
    ),
    (
        "deployment container read with a connection string",
        R,
        "type: 'UserAssignedIdentity'",
        "type: 'StorageAccountConnectionString'",
        check_no_key_based_storage,
    ),
    (
        "host storage without identity",
        R,
        "AzureWebJobsStorage__credential: 'managedidentity'",
        "AzureWebJobsStorage__credential: 'none'",
        check_no_key_based_storage,
    ),
    (
        "blob owner role on the wrong principal",
        R,
        "guid(storage.id, identity.id, storageBlobDataOwnerRole)\n  scope: storage\n  properties: {\n"
        "    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataOwnerRole)\n"
        "    principalId: identity.properties.principalId",
        "guid(storage.id, identity.id, storageBlobDataOwnerRole)\n  scope: storage\n  properties: {\n"
        "    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataOwnerRole)\n"
        "    principalId: principalId",
        check_blob_owner_role,
    ),
    (
        "blob reader instead of owner",
        R,
        "var storageBlobDataOwnerRole = 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'",
        "var storageBlobDataOwnerRole = '2a2b9908-6ea1-4ae2-8e65-a410df84e7d1'",
        check_blob_owner_role,
    ),
    ("http allowed", R, "httpsOnly: true", "httpsOnly: false", check_https_and_tls),
    ("TLS 1.0", R, "      minTlsVersion: '1.2'", "      minTlsVersion: '1.0'", check_https_and_tls),
    ("storage TLS 1.0", R, "minimumTlsVersion: 'TLS1_2'", "minimumTlsVersion: 'TLS1_0'", check_https_and_tls),
    (
        "connection string output",
        R,
        "output identityClientId string = identity.properties.clientId",
        "output identityClientId string = appInsights.properties.ConnectionString",
        check_no_secrets_in_outputs,
    ),
    (
        "listKeys output",
        M,
        "output AZURE_TENANT_ID string = tenant().tenantId",
        "output AZURE_TENANT_ID string = listKeys(rg.id, '2023-01-01').keys[0].value",
        check_no_secrets_in_outputs,
    ),
    (
        "secure parameter output",
        M,
        "output CHAT_UPSTREAM string = upstream",
        "output CHAT_UPSTREAM string = openAiApiKey",
        check_no_secrets_in_outputs,
    ),
    (
        "OpenAI User role missing",
        R,
        "var cognitiveServicesOpenAIUserRole = '5e0bd9bd-7b93-4f28-af87-19fc36ad61bd'",
        "var cognitiveServicesOpenAIUserRole = 'a001fd3d-188f-4b5d-821b-7da978bf7442'",
        check_azure_openai_keyless,
    ),
    (
        "Azure OpenAI keys allowed",
        R,
        "disableLocalAuth: true\n    // The account itself",
        "disableLocalAuth: false\n    // The account itself",
        check_azure_openai_keyless,
    ),
    (
        "no AZURE_CLIENT_ID",
        R,
        "  AZURE_CLIENT_ID: identity.properties.clientId\n",
        "  AZURE_CLIENT_ID_UNUSED: identity.properties.clientId\n",
        check_azure_openai_keyless,
    ),
    (
        "Key Vault Secrets User missing",
        R,
        "var keyVaultSecretsUserRole = '4633458b-17de-408a-b874-0445c86b69e6'",
        "var keyVaultSecretsUserRole = '21090545-7ca7-4776-b22c-e363652d74d2'",
        check_key_vault_mode,
    ),
    (
        "key as a plain app setting",
        R,
        "useKeyVault ? '@Microsoft.KeyVault(SecretUri=${keyVault.properties.vaultUri}secrets/${openAiKeySecretName})' : ''",
        "openAiApiKey",
        check_key_vault_mode,
    ),
    (
        "Key Vault reference without the user identity",
        R,
        "    keyVaultReferenceIdentity: identity.id\n",
        "",
        check_key_vault_mode,
    ),
    (
        "key not @secure",
        M,
        "@secure()\n@description('OpenAI API key",
        "@description('OpenAI API key",
        check_key_vault_mode,
    ),
    (
        "empty key deploys",
        M,
        "var openAiKeyMissing = upstream == 'openAI' && empty(openAiApiKey)",
        "var openAiKeyMissing = false",
        check_openai_key_required,
    ),
    (
        "secret rewritten on every deployment",
        R,
        "'Microsoft.KeyVault/vaults/secrets@2023-07-01' = if (writeKeySecret)",
        "'Microsoft.KeyVault/vaults/secrets@2023-07-01' = if (useKeyVault)",
        check_key_vault_secret_kept,
    ),
    (
        "a vault key mode that drops the vault",
        R,
        "(!empty(openAiApiKey) || openAiKeyInVault)",
        "!empty(openAiApiKey)",
        check_key_vault_secret_kept,
    ),
    (
        "settings before the secret",
        R,
        "  dependsOn: [\n    openAiKeySecret\n  ]\n",
        "",
        check_key_vault_secret_kept,
    ),
    (
        "two api-versions",
        M,
        "param azureOpenAiApiVersion string = ''",
        "param azureOpenAiApiVersion string = '2025-04-01-preview'",
        check_api_version,
    ),
    (
        "azd's default a dated version",
        "infra/main.parameters.json",
        "${AZURE_OPENAI_API_VERSION}",
        "${AZURE_OPENAI_API_VERSION=2024-10-21}",
        check_api_version,
    ),
    (
        "deploy.md on a dated default",
        "docs/deploy.md",
        "(empty: the GA v1 API)",
        "`2024-10-21`",
        check_api_version,
    ),
    ("Elastic Premium plan", R, "name: 'FC1'", "name: 'EP1'", check_flex_consumption_python),
    ("Python 3.11", R, "version: '3.13'", "version: '3.11'", check_flex_consumption_python),
    (
        "worker runtime app setting",
        R,
        "  USAGE_WAIT_SECONDS: '2'\n",
        "  FUNCTIONS_WORKER_RUNTIME: 'python'\n",
        check_flex_consumption_python,
    ),
    (
        "worker process count on Flex",
        R,
        "  UPSTREAM_MAX_RETRIES: '2'\n",
        "  FUNCTIONS_WORKER_PROCESS_COUNT: '2'\n",
        check_flex_consumption_python,
    ),
    (
        "ftpsState on Flex",
        R,
        "      minTlsVersion: '1.2'\n",
        "      minTlsVersion: '1.2'\n      ftpsState: 'Disabled'\n",
        check_flex_consumption_python,
    ),
    (
        "alwaysOn on Flex",
        R,
        "      minTlsVersion: '1.2'\n",
        "      minTlsVersion: '1.2'\n      alwaysOn: false\n",
        check_flex_consumption_python,
    ),
    ("App Insights local auth", R, "DisableLocalAuth: true", "DisableLocalAuth: false", check_app_insights_identity),
    (
        "spans sampled",
        R,
        "OTEL_TRACES_SAMPLER: 'always_on'",
        "OTEL_TRACES_SAMPLER: 'microsoft.rate_limited'",
        check_app_insights_identity,
    ),
    (
        "App Insights without identity",
        R,
        "APPLICATIONINSIGHTS_AUTHENTICATION_STRING: 'ClientId=${identity.properties.clientId};Authorization=AAD'",
        "APPLICATIONINSIGHTS_AUTHENTICATION_STRING: ''",
        check_app_insights_identity,
    ),
    (
        "total timeout at functionTimeout",
        M,
        "param totalTimeoutSeconds int = 600",
        "param totalTimeoutSeconds int = 1800",
        check_time_limits,
    ),
    (
        "total timeout may exceed functionTimeout",
        M,
        "@maxValue(1740)\n@description('TOTAL",
        "@maxValue(3600)\n@description('TOTAL",
        check_time_limits,
    ),
    (
        "total timeout not set",
        R,
        "  TOTAL_TIMEOUT_SECONDS: string(totalTimeoutSeconds)\n",
        "  TOTAL_TIMEOUT: string(totalTimeoutSeconds)\n",
        check_time_limits,
    ),
    ("heartbeat past the idle cut-off", M, "@maxValue(200)", "@maxValue(300)", check_time_limits),
    (
        "no capacity parameter",
        M,
        "param deploymentCapacity int = 250",
        "var deploymentCapacity = 250",
        check_parameters,
    ),
    ("azd service tag mismatch", R, "'azd-service-name': 'api'", "'azd-service-name': 'web'", check_azure_yaml),
    ("not a function host", "azure.yaml", "host: function", "host: containerapp", check_azure_yaml),
    ("any azd version", "azure.yaml", 'azd: ">= 1.23.4"', 'azd: ">= 1.0.0"', check_azure_yaml),
    ("azure.yaml not YAML", "azure.yaml", "services:\n", "services: [\n", check_azure_yaml),
    (
        "deploy.md: every call needs a key",
        "docs/deploy.md",
        "In Azure the routes take these keys:",
        "In Azure every call needs a key:",
        check_deploy_doc_keys,
    ),
    (
        "deploy.md: every route has auth level function",
        "docs/deploy.md",
        "In Azure the routes take these keys:",
        "Every route of the app has auth level `function`. In Azure the routes take these keys:",
        check_deploy_doc_keys,
    ),
    (
        "deploy.md: the admin routes left out",
        "docs/deploy.md",
        "| `/api/manage/…` (the admin API",
        "| the admin API (",
        check_deploy_doc_keys,
    ),
    (
        "another admin route, not in deploy.md",
        "function_app.py",
        '@app.route(route="_pool", methods=["GET"])',
        '@app.route(route="admin/pool", methods=["GET"], auth_level=func.AuthLevel.ADMIN)',
        check_deploy_doc_keys,
    ),
    (
        "another anonymous route, not in deploy.md",
        "function_app.py",
        '@app.route(route="_pool", methods=["GET"])',
        '@app.route(route="_pool", methods=["GET"], auth_level=func.AuthLevel.ANONYMOUS)',
        check_deploy_doc_keys,
    ),
    (
        "per-instance concurrency guessed",
        M,
        _CONCURRENCY,
        "param httpPerInstanceConcurrency int = 16",
        check_scaling_defaults,
    ),
    (
        "network isolation on by default",
        M,
        "param vnetEnabled bool = false",
        "param vnetEnabled bool = true",
        check_private_network,
    ),
    (
        "app subnet not delegated for Flex",
        R,
        "serviceName: 'Microsoft.App/environments'",
        "serviceName: 'Microsoft.Web/serverFarms'",
        check_private_network,
    ),
    ("no table private endpoint", R, "groupId: 'table'", "groupId: 'file'", check_private_network),
    (
        "Azure OpenAI public with vnetEnabled",
        R,
        "    publicNetworkAccess: vnetEnabled ? 'Disabled' : 'Enabled'\n    networkAcls: {\n"
        "      defaultAction: vnetEnabled ? 'Deny' : 'Allow'\n    }\n    disableLocalAuth",
        "    publicNetworkAccess: 'Enabled'\n    networkAcls: {\n"
        "      defaultAction: vnetEnabled ? 'Deny' : 'Allow'\n    }\n    disableLocalAuth",
        check_private_network,
    ),
    (
        "private zone not linked to the network",
        "infra/private-link.bicep",
        "      id: virtualNetworkId\n",
        "      id: subnetId\n",
        check_private_network,
    ),
    (
        "workspace keys allowed",
        R,
        "      disableLocalAuth: true\n",
        "      disableLocalAuth: false\n",
        check_diagnostics,
    ),
    (
        "Key Vault logs sent nowhere",
        R,
        "  name: 'to-log-analytics'\n  scope: keyVault\n",
        "  name: 'to-log-analytics'\n  scope: appInsights\n",
        check_diagnostics,
    ),
    (
        "function app logs left out",
        R,
        "category: 'FunctionAppLogs'",
        "category: 'AppServiceHTTPLogs'",
        check_diagnostics,
    ),
    (
        "Azure OpenAI may call out",
        R,
        "restrictOutboundNetworkAccess: true",
        "restrictOutboundNetworkAccess: false",
        check_hardening,
    ),
    (
        "purge protection always on",
        R,
        "enablePurgeProtection: keyVaultPurgeProtection ? true : null",
        "enablePurgeProtection: true",
        check_hardening,
    ),
    (
        "soft delete a week",
        M,
        "param keyVaultSoftDeleteRetentionDays int = 90",
        "param keyVaultSoftDeleteRetentionDays int = 7",
        check_hardening,
    ),
    (
        "zone-redundant plan on LRS storage",
        R,
        "name: zoneRedundant ? 'Standard_ZRS' : 'Standard_LRS'",
        "name: 'Standard_LRS'",
        check_hardening,
    ),
    (
        "no container delete retention",
        R,
        "    containerDeleteRetentionPolicy: {\n      enabled: true",
        "    containerDeleteRetentionPolicy: {\n      enabled: false",
        check_hardening,
    ),
    (
        "principalType not mapped for azd",
        "infra/main.parameters.json",
        '"${AZURE_PRINCIPAL_TYPE=User}"',
        '"User"',
        check_principal_type,
    ),
    (
        "deployer's table roles always as a user",
        R,
        "    principalId: principalId\n    principalType: principalType\n  }\n}]",
        "    principalId: principalId\n    principalType: 'User'\n  }\n}]",
        check_principal_type,
    ),
    (
        "table role on the whole account",
        R,
        "  scope: appTables[i]\n  properties: {\n    roleDefinitionId: subscriptionResourceId("
        "'Microsoft.Authorization/roleDefinitions', storageTableDataContributorRole)\n"
        "    principalId: identity.properties.principalId",
        "  scope: storage\n  properties: {\n    roleDefinitionId: subscriptionResourceId("
        "'Microsoft.Authorization/roleDefinitions', storageTableDataContributorRole)\n"
        "    principalId: identity.properties.principalId",
        check_app_state_storage,
    ),
    ("a table missing", R, "  'chatstreamUsage'\n", "", check_app_state_storage),
    (
        "deployer's stream-log container role missing",
        R,
        "resource streamsContributorForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (!empty(principalId))",
        "resource streamsContributorForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (false)",
        check_app_state_storage,
    ),
    (
        "no table service URI for the app",
        R,
        "  AzureWebJobsStorage__tableServiceUri: ",
        "  AzureWebJobsStorage__tableUri: ",
        check_app_state_storage,
    ),
    (
        "scaling table edited by hand",
        "docs/scaling.md",
        _HELD,
        re.sub(r"\*\*\d+\*\*", "**6000**", _HELD),
        check_scaling_defaults,
    ),
    (
        "benchmark figures changed, scaling not recomputed",
        "docs/benchmarks.md",
        _SPLIT,
        _SPLIT.rsplit("/", 1)[0] + "/ 9.999 |",
        check_scaling_defaults,
    ),
    (
        "a retired default model",
        M,
        "param modelVersion string = '2026-03-17'",
        "param modelVersion string = '2024-07-18'",
        check_model_default,
    ),
    (
        "version upgrade left to Azure",
        R,
        "    versionUpgradeOption: modelVersionUpgradeOption\n",
        "",
        check_model_default,
    ),
    (
        "settings declared whole",
        R,
        "      scmMinTlsVersion: '1.2'\n",
        "      scmMinTlsVersion: '1.2'\n      appSettings: []\n",
        check_app_settings_layers,
    ),
    (
        "current settings not read",
        R,
        "currentAppSettings: list('${functionApp.id}/config/appsettings', '2024-11-01').properties",
        "currentAppSettings: {}",
        check_app_settings_layers,
    ),
    (
        "defaults over the portal",
        "infra/app-settings.bicep",
        "union(templateDefaults, currentAppSettings, operatorSettings, templateSettings)",
        "union(currentAppSettings, templateDefaults, operatorSettings, templateSettings)",
        check_app_settings_layers,
    ),
    (
        "owned settings silently overwritten",
        R,
        "empty(refusedSettings) ? mapValues(appSettings, value => string(value)) : fail(refusedMessage)",
        "mapValues(appSettings, value => string(value))",
        check_app_settings_layers,
    ),
    (
        "current settings in the history",
        "infra/app-settings.bicep",
        "@secure()\n@description('The site",
        "@description('The site",
        check_app_settings_layers,
    ),
    (
        "CHAT_APP_SETTINGS in the history",
        M,
        "@secure()\n@description('App settings",
        "@description('App settings",
        check_app_settings_layers,
    ),
    (
        "CHAT_APP_SETTINGS in the module's history",
        "infra/app-settings.bicep",
        "@secure()\n@description('CHAT_APP_SETTINGS",
        "@description('CHAT_APP_SETTINGS",
        check_app_settings_layers,
    ),
    (
        "CHAT_APP_SETTINGS in resources' history",
        R,
        "@secure()\nparam appSettings object",
        "param appSettings object",
        check_app_settings_layers,
    ),
    (
        "a preview update strategy by default",
        M,
        "param siteUpdateStrategy string = 'Recreate'",
        "param siteUpdateStrategy string = 'RollingUpdate'",
        check_site_update_strategy,
    ),
    (
        "azd's update strategy differs",
        "infra/main.parameters.json",
        '"${AZURE_SITE_UPDATE_STRATEGY=Recreate}"',
        '"${AZURE_SITE_UPDATE_STRATEGY=RollingUpdate}"',
        check_site_update_strategy,
    ),
    (
        "two requests a minute",
        M,
        "param deploymentCapacity int = 250",
        "param deploymentCapacity int = 10",
        check_capacity,
    ),
    ("no template output cap", R, "  DEFAULT_MAX_OUTPUT_TOKENS: '4096'\n", "", check_capacity),
    (
        "a bigger cap, same capacity",
        R,
        "DEFAULT_MAX_OUTPUT_TOKENS: '4096'",
        "DEFAULT_MAX_OUTPUT_TOKENS: '16384'",
        check_capacity,
    ),
    (
        "deploy.md: stale arithmetic",
        "docs/deploy.md",
        "= **49** requests",
        "= **2** requests",
        check_capacity,
    ),
    (
        "production.md: a team larger than the deployment",
        "docs/production.md",
        '"tokens_per_minute": 150000',
        '"tokens_per_minute": 400000',
        check_capacity,
    ),
    (
        "no NAT gateway on the app subnet",
        R,
        "          natGateway: useNatGateway ? {\n            id: nat.id\n          } : null\n",
        "",
        check_outbound_network,
    ),
    (
        "NAT idle timeout shorter than the first token",
        R,
        "idleTimeoutInMinutes: max(4, (max(firstTokenTimeoutSeconds, idleTimeoutSeconds) + 59) / 60)",
        "idleTimeoutInMinutes: 4",
        check_outbound_network,
    ),
    (
        "openAI in a closed network deploys",
        M,
        "var noWayOut = vnetEnabled && !natGateway && upstream == 'openAI' && empty(openAiBaseUrl)",
        "var noWayOut = false",
        check_outbound_network,
    ),
    ("Key Vault references outside the network", R, "allTraffic: true", "allTraffic: false", check_outbound_network),
    (
        "at least 40 instances",
        M,
        "@minValue(1)\n@maxValue(1000)\n@description('Most instances",
        "@minValue(40)\n@maxValue(1000)\n@description('Most instances",
        check_scale_limits,
    ),
    (
        "instance cap not an azd value",
        "infra/main.parameters.json",
        '"${AZURE_MAXIMUM_INSTANCE_COUNT=100}"',
        '"100"',
        check_scale_limits,
    ),
    ("always-ready not written", R, "instanceCount: alwaysReadyInstances", "instanceCount: 1", check_scale_limits),
    (
        "diagnostic events left on",
        R,
        "  AzureWebJobsFeatureFlags: 'DisableDiagnosticEventLogging'\n",
        "",
        check_host_diagnostic_events,
    ),
    ("a queue endpoint", R, "groupId: 'blob'", "groupId: 'queue'", check_private_network),
    (
        "stream logs expire before their TTL",
        R,
        "daysAfterModificationGreaterThan: streamLogLifetimeDays",
        "daysAfterModificationGreaterThan: 1",
        check_stream_log_lifecycle,
    ),
    (
        "lifecycle rule on another container",
        R,
        "'${streamsContainerName}/'",
        "'${deploymentContainerName}/'",
        check_stream_log_lifecycle,
    ),
    (
        "deploy.md: an old concurrency",
        "docs/deploy.md",
        _DEPLOY_CONCURRENCY,
        "`httpPerInstanceConcurrency` (50)",
        check_deploy_doc_scaling,
    ),
    (
        "deploy.md: an old cost",
        "docs/deploy.md",
        _DEPLOY_COST,
        "($10.80 per million typical streams)",
        check_deploy_doc_scaling,
    ),
    (
        "keyless server refused",
        M,
        "var openAiKeyMissing = upstream == 'openAI' && empty(openAiApiKey) && empty(openAiBaseUrl) && !openAiKeyInVault",
        "var openAiKeyMissing = upstream == 'openAI' && empty(openAiApiKey)",
        check_keyless_compatible_server,
    ),
    (
        "a vault for no key",
        R,
        "var useKeyVault = upstream == 'openAI' && (!empty(openAiApiKey) || openAiKeyInVault)",
        "var useKeyVault = upstream == 'openAI'",
        check_keyless_compatible_server,
    ),
    (
        "azd default differs from the Bicep default",
        "infra/main.parameters.json",
        '"${TOTAL_TIMEOUT_SECONDS=600}"',
        '"${TOTAL_TIMEOUT_SECONDS=900}"',
        check_parameters,
    ),
]


@pytest.mark.parametrize("what,path,old,new,check", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_check_catches(infra, what, path, old, new, check):
    broken = infra.broken(path, old, new)
    with pytest.raises((AssertionError, yaml.YAMLError)):
        check(broken)


def test_templates_parse_with_the_installed_grammar():
    """tree-sitter-bicep 1.1.0 loads with the installed tree-sitter (ABI) and rejects bad Bicep."""
    assert not parse_errors(PARSER.parse(b"param x string = 'a'\n"))
    assert parse_errors(PARSER.parse(b"resource x 'a@1' = {\n  name: \n"))
