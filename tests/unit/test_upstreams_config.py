"""chatstream/upstreams/config.py: UPSTREAMS validated and parsed into entries (and the single
upstream's settings as one entry)."""

from __future__ import annotations

import json

import pytest

from chatstream.settings import Settings, SettingsError
from chatstream.upstreams.config import MAX_DEPTH, MAX_ENTRIES, entries, parse_upstreams
from chatstream.upstreams.pool import Pool

from .upstream_helpers import SECRET, make_pool, names, retry_after

# --- UPSTREAMS --------------------------------------------------------------------------------

ENV = {"PAYGO_KEY": SECRET, "OPENAI_KEY": SECRET + "-openai"}


def test_a_valid_upstreams_value():
    raw = json.dumps(
        [
            {
                "name": "ptu",
                "azure_endpoint": "https://ptu.openai.azure.com/",
                "priority": 1,
                "models": ["gpt-4o"],
                "deployments": {"gpt-4o": "gpt4o-ptu"},
            },
            {
                "name": "paygo-eastus",
                "azure_endpoint": "https://eastus.openai.azure.com",
                "api_version": "2025-01-01",
                "api_key_setting": "PAYGO_KEY",
                "priority": 2,
                "weight": 2,
            },
            {
                "name": "openai",
                "base_url": "https://api.openai.com/v1",
                "api_key_setting": "OPENAI_KEY",
                "priority": 3,
                "weight": 0.5,
            },
            {
                "name": "local",
                "base_url": "http://127.0.0.1:8000/v1",
                "priority": 4,
                "deployments": {"gpt-4o-mini": "llama-3.1-8b"},
            },
        ]
    )
    ptu, paygo, oai, local = parse_upstreams(raw, ENV)
    assert (ptu.kind, ptu.url, ptu.api_version, ptu.auth) == (
        "azure",
        "https://ptu.openai.azure.com",
        None,  # Azure's GA v1 API
        "entra",
    )
    assert ptu.models == ("gpt-4o",) and ptu.deployment("gpt-4o") == "gpt4o-ptu"
    assert (paygo.api_version, paygo.auth, paygo.api_key.get_secret_value(), paygo.weight) == (
        "2025-01-01",
        "key",
        SECRET,
        2.0,
    )
    assert (oai.kind, oai.url, oai.key_setting) == ("openai", "https://api.openai.com/v1", "OPENAI_KEY")
    assert (local.auth, local.priority, local.weight, local.models) == ("none", 4, 1.0, None)
    assert local.deployment("gpt-4o-mini") == "llama-3.1-8b" and local.deployment("gpt-4o") == "gpt-4o"


BAD = [
    ("not json", "{", "UPSTREAMS: not valid JSON"),
    ("not a list", {"name": "a", "base_url": "http://a"}, "UPSTREAMS: must be a JSON list"),
    ("empty", [], "UPSTREAMS: the list is empty"),
    ("not an object", ["a"], "UPSTREAMS[0]: must be a JSON object"),
    ("nan", '[{"name": "a", "base_url": "http://a", "weight": NaN}]', "NaN is not a JSON number"),
    ("duplicate json key", '[{"name": "a", "base_url": "http://a", "name": "b"}]', 'the key "name" appears twice'),
    (
        "unknown key",
        [{"name": "eastus", "base_url": "http://a", "region": "eastus"}],
        'UPSTREAMS[0] ("eastus"): region: unknown key',
    ),
    (
        "a key inline",
        [{"name": "eastus", "base_url": "http://a", "api_key": SECRET}],
        'UPSTREAMS[0] ("eastus"): api_key: unknown key (a key never goes in UPSTREAMS',
    ),
    ("no name", [{"base_url": "http://a"}], "UPSTREAMS[0]: name: Field required"),
    ("bad name", [{"name": "east us", "base_url": "http://a"}], "name: use letters, digits"),
    (
        "duplicate name",
        [{"name": "eastus", "base_url": "http://a"}, {"name": "EastUS", "base_url": "http://b"}],
        'UPSTREAMS[1] ("EastUS"): name: the same name as UPSTREAMS[0]',
    ),
    (
        "both urls",
        [{"name": "a", "base_url": "http://a", "azure_endpoint": "https://a"}],
        'UPSTREAMS[0] ("a"): needs exactly one of base_url',
    ),
    ("neither url", [{"name": "a", "priority": 2}], 'UPSTREAMS[0] ("a"): needs exactly one of base_url'),
    ("weight 0", [{"name": "a", "base_url": "http://a", "weight": 0}], "weight: Input should be greater than 0"),
    ("weight < 0", [{"name": "a", "base_url": "http://a", "weight": -1}], "weight: Input should be greater than 0"),
    (
        "weight a string",
        [{"name": "a", "base_url": "http://a", "weight": "2"}],
        "weight: Input should be a valid number",
    ),
    (
        "priority 1.5",
        [{"name": "a", "base_url": "http://a", "priority": 1.5}],
        "priority: Input should be a valid integer",
    ),
    (
        "priority a string",
        [{"name": "a", "base_url": "http://a", "priority": "1"}],
        "priority: Input should be a valid",
    ),
    ("priority true", [{"name": "a", "base_url": "http://a", "priority": True}], "priority: Input should be a valid"),
    ("priority < 0", [{"name": "a", "base_url": "http://a", "priority": -1}], "priority: Input should be greater"),
    (
        "missing key setting",
        [{"name": "eastus-paygo", "azure_endpoint": "https://a", "api_key_setting": "NOPE"}],
        'UPSTREAMS[0] ("eastus-paygo"): api_key_setting: the app setting NOPE is not set or empty',
    ),
    (
        "empty key setting",
        [{"name": "a", "base_url": "http://a", "api_key_setting": "EMPTY"}],
        "the app setting EMPTY is not set or empty",
    ),
    (
        "unresolved key vault reference",
        [{"name": "a", "base_url": "http://a", "api_key_setting": "KV"}],
        "holds an unresolved Key Vault reference",
    ),
    (
        "bad setting name",
        [{"name": "a", "base_url": "http://a", "api_key_setting": "MY-KEY"}],
        "api_key_setting: must be the name of an app setting",
    ),
    (
        "url without scheme",
        [{"name": "a", "base_url": "api.openai.com/v1"}],
        "base_url: must be an http:// or https://",
    ),
    ("ftp url", [{"name": "a", "azure_endpoint": "ftp://a"}], "azure_endpoint: must be an http:// or https://"),
    ("url with credentials", [{"name": "a", "base_url": f"https://u:{SECRET}@a/v1"}], "must not carry credentials"),
    ("url with a bad port", [{"name": "a", "base_url": "http://a:99999/v1"}], "base_url: is not a valid URL"),
    ("url with a query", [{"name": "a", "base_url": f"http://a/v1?key={SECRET}"}], "must not have a query"),
    ("url not a string", [{"name": "a", "base_url": 5}], "base_url: Input should be a valid string"),
    (
        "api_version on openai",
        [{"name": "a", "base_url": "http://a", "api_version": "x"}],
        "api_version: only for an azure_endpoint entry",
    ),
    (
        "deployment of an unlisted model on openai",
        [{"name": "a", "base_url": "http://a", "models": ["m"], "deployments": {"n": "d"}}],
        "deployments: maps 'n', which models does not",
    ),
    (
        "deployment of an unlisted model",
        [{"name": "a", "azure_endpoint": "https://a", "models": ["m"], "deployments": {"n": "d"}}],
        "deployments: maps 'n', which models does not",
    ),
    ("empty models", [{"name": "a", "base_url": "http://a", "models": []}], "models: List should have at least 1"),
    (
        "models not a list",
        [{"name": "a", "base_url": "http://a", "models": "gpt-4o"}],
        "models: Input should be a valid list",
    ),
    (
        "model listed twice",
        [{"name": "a", "base_url": "http://a", "models": ["m", "m"]}],
        "models: a model is listed twice",
    ),
]


@pytest.mark.parametrize("value, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_upstreams_values_are_refused_with_a_clear_message(value, expected):
    raw = value if isinstance(value, str) else json.dumps(value)
    env = dict(ENV, EMPTY="", KV="@Microsoft.KeyVault(SecretUri=https://kv.vault.azure.net/secrets/k/)")
    with pytest.raises(SettingsError) as caught:
        parse_upstreams(raw, env)
    message = str(caught.value)
    assert expected in message
    assert SECRET not in message and "vault.azure.net" not in message
    # No chained error (pydantic's own text quotes the input) reaches a traceback.
    assert caught.value.__cause__ is None and (caught.value.__context__ is None or caught.value.__suppress_context__)


def test_every_problem_is_listed_at_once():
    raw = json.dumps(
        [
            {"name": "a", "base_url": "http://a", "weight": 0},
            {"name": "b", "base_url": "http://b"},
            {"name": "c", "azure_endpoint": "https://c", "api_key_setting": "C_KEY"},
        ]
    )
    with pytest.raises(SettingsError) as caught:
        parse_upstreams(raw, {})
    assert 'UPSTREAMS[0] ("a"): weight' in str(caught.value)
    assert 'UPSTREAMS[2] ("c"): api_key_setting' in str(caught.value)
    assert "UPSTREAMS[1]" not in str(caught.value)


def test_without_upstreams_the_single_upstream_settings_form_a_one_entry_pool():
    settings = Settings.from_env(
        {"AZURE_OPENAI_ENDPOINT": "https://r.openai.azure.com/", "AZURE_OPENAI_DEPLOYMENT": "gpt-4o"}
    )
    (only,) = entries(settings, {})
    assert (only.name, only.kind, only.url, only.auth, only.models) == (
        "default",
        "azure",
        "https://r.openai.azure.com",
        "entra",
        None,
    )
    settings = Settings.from_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": SECRET})
    assert entries(settings, {})[0].api_key.get_secret_value() == SECRET and entries(settings, {})[0].kind == "openai"
    assert entries(settings, {})[0].deployment("any-model") == "any-model"
    empty = Pool(entries(Settings.from_env({}), {}))
    assert not empty.entries and empty.candidates("m") == [] and retry_after(empty, "m") is None


def test_upstreams_wins_over_the_single_upstream_settings():
    raw = json.dumps([{"name": "openai", "base_url": "https://api.openai.com/v1", "api_key_setting": "OPENAI_API_KEY"}])
    env = {"UPSTREAMS": raw, "OPENAI_API_KEY": SECRET}
    assert names(entries(Settings.from_env(env), env)) == ["openai"]


def test_the_examples_in_docs_pool_md_are_valid():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "pool.md").read_text()
    examples = [block for block in re.findall(r"```json\n(.*?)```", text, re.S) if block.lstrip().startswith("[")]
    assert len(examples) == 2
    ptu = parse_upstreams(examples[0], {"AOAI_WESTUS3_KEY": SECRET})
    assert [(e.name, e.priority, e.weight, e.auth) for e in ptu] == [
        ("ptu-swedencentral", 1, 1.0, "entra"),
        ("paygo-eastus2", 2, 2.0, "entra"),
        ("paygo-westus3", 2, 1.0, "key"),
    ]
    pool, _ = make_pool(*ptu)
    assert names(pool.candidates("gpt-4o"))[0] == "ptu-swedencentral"
    assert "ptu-swedencentral" not in names(pool.candidates("gpt-4o-mini"))
    last_resort = parse_upstreams(examples[1], {"OPENAI_API_KEY": SECRET})
    assert [e.deployment("gpt-4o") for e in last_resort] == ["prod-gpt4o", "prod-gpt4o", "gpt-4o"]


@pytest.mark.parametrize(
    "name, url",
    [
        ("OPENAI_BASE_URL", "http://user:pass@up.test/v1"),
        ("OPENAI_BASE_URL", "http://up.test/v1?api-key=SECRET"),
        ("AZURE_OPENAI_ENDPOINT", "https://u:SECRET@r.openai.azure.com"),
    ],
)
def test_the_single_upstream_url_is_checked_like_an_upstreams_entry(name, url):
    env = {name: url, "AZURE_OPENAI_DEPLOYMENT": "d"}
    with pytest.raises(SettingsError) as caught:
        entries(Settings.from_env(env), env)
    assert name in str(caught.value) and "SECRET" not in str(caught.value) and "pass" not in str(caught.value)


def test_upstreams_is_bounded_in_entries_and_nesting():
    many = json.dumps([{"name": f"e{i}", "base_url": f"http://e{i}/v1"} for i in range(MAX_ENTRIES + 1)])
    with pytest.raises(SettingsError, match=f"UPSTREAMS: {MAX_ENTRIES + 1} entries; at most {MAX_ENTRIES}"):
        parse_upstreams(many, {})
    assert len(parse_upstreams(json.dumps(json.loads(many)[:MAX_ENTRIES]), {})) == MAX_ENTRIES
    with pytest.raises(SettingsError, match="UPSTREAMS: nested deeper than"):
        parse_upstreams("[" * 30_000 + "]" * 30_000, {})
    with pytest.raises(SettingsError, match=f"UPSTREAMS: nested deeper than {MAX_DEPTH} levels"):
        parse_upstreams("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), {})  # parsed, then too deep
    with pytest.raises(SettingsError, match="UPSTREAMS: longer than"):
        parse_upstreams(" " * 300_000 + "[]", {})


def test_an_entry_may_declare_its_context_window():
    small, large = parse_upstreams(
        json.dumps(
            [
                {"name": "small", "base_url": "http://a", "context_window": 8192},
                {"name": "large", "base_url": "http://b"},
            ]
        ),
        ENV,
    )
    assert (small.context_window, large.context_window) == (8192, None)
    for bad in (0, "8k", 1.5):
        with pytest.raises(SettingsError, match="context_window"):
            parse_upstreams(json.dumps([{"name": "a", "base_url": "http://a", "context_window": bad}]), ENV)
