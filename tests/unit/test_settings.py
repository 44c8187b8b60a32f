"""chatstream/settings.py: app settings from the environment, validated once, errors that name the
setting and never its value."""

from __future__ import annotations

import pydantic
import pytest

from chatstream.settings import Settings, SettingsError


def test_defaults_with_nothing_set():
    s = Settings.from_env({})
    assert s.upstream_kind == "none" and not s.upstream_configured
    assert s.default_model == "gpt-4o-mini"
    assert (s.first_token_timeout, s.idle_timeout, s.total_timeout) == (120.0, 60.0, 600.0)
    assert (s.heartbeat, s.usage_wait, s.upstream_max_retries) == (15.0, 2.0, 2)
    assert s.max_body_bytes == 1_048_576
    assert s.allowed_models == () and s.blocked_terms == ()
    assert s.system_prompt is None and s.max_prompt_chars is None


def test_unknown_variables_and_empty_values_are_ignored():
    s = Settings.from_env({"PATH": "/bin", "OPENAI_MODEL": "", "IDLE_TIMEOUT_SECONDS": "", "SOMETHING": "x"})
    assert s.openai_model == "gpt-4o-mini" and s.idle_timeout == 60.0


def test_values_are_parsed_from_strings():
    s = Settings.from_env(
        {
            "OPENAI_API_KEY": "k",
            "FIRST_TOKEN_TIMEOUT_SECONDS": "2.5",
            "UPSTREAM_MAX_RETRIES": "0",
            "MAX_BODY_BYTES": "1000",
            "MAX_PROMPT_CHARS": "300",
            "USAGE_WAIT_SECONDS": "0",
        }
    )
    assert (s.first_token_timeout, s.upstream_max_retries, s.max_body_bytes) == (2.5, 0, 1000)
    assert s.max_prompt_chars == 300 and s.usage_wait == 0


def test_comma_lists_are_split_and_trimmed():
    s = Settings.from_env({"ALLOWED_MODELS": " a, b ,,c ,", "BLOCKED_TERMS": "x y, z"})
    assert s.allowed_models == ("a", "b", "c")
    assert s.blocked_terms == ("x y", "z")
    assert Settings.from_env({"ALLOWED_MODELS": " , "}).allowed_models == ()


@pytest.mark.parametrize(
    "env, kind",
    [
        ({}, "none"),
        ({"OPENAI_API_KEY": "k"}, "openai"),
        ({"OPENAI_BASE_URL": "http://localhost:8000/v1"}, "openai"),
        ({"AZURE_OPENAI_ENDPOINT": "https://x.openai.azure.com", "AZURE_OPENAI_DEPLOYMENT": "d"}, "azure"),
        # Azure wins when both are set.
        (
            {
                "OPENAI_API_KEY": "k",
                "AZURE_OPENAI_ENDPOINT": "https://x.openai.azure.com",
                "AZURE_OPENAI_DEPLOYMENT": "d",
            },
            "azure",
        ),
    ],
)
def test_upstream_kind(env, kind):
    s = Settings.from_env(env)
    assert s.upstream_kind == kind
    assert s.upstream_configured == (kind != "none")


def test_default_model_is_the_deployment_on_azure():
    s = Settings.from_env(
        {
            "AZURE_OPENAI_ENDPOINT": "https://x.openai.azure.com",
            "AZURE_OPENAI_DEPLOYMENT": "dep",
            "OPENAI_MODEL": "ignored",
        }
    )
    assert s.default_model == "dep"
    assert Settings.from_env({"OPENAI_API_KEY": "k", "OPENAI_MODEL": "m"}).default_model == "m"


def test_azure_needs_a_deployment():
    with pytest.raises(SettingsError, match="AZURE_OPENAI_DEPLOYMENT is required"):
        Settings.from_env({"AZURE_OPENAI_ENDPOINT": "https://x.openai.azure.com"})


def test_urls_must_be_http_and_lose_their_trailing_slash():
    s = Settings.from_env(
        {"OPENAI_BASE_URL": "https://h/v1//", "AZURE_OPENAI_ENDPOINT": "http://a/", "AZURE_OPENAI_DEPLOYMENT": "d"}
    )
    assert s.openai_base_url == "https://h/v1" and s.azure_openai_endpoint == "http://a"
    with pytest.raises(SettingsError, match="OPENAI_BASE_URL: .*http:// or https://"):
        Settings.from_env({"OPENAI_BASE_URL": "ftp://h"})


def test_blank_key_and_system_prompt_are_unset():
    s = Settings.model_validate({"OPENAI_API_KEY": "", "SYSTEM_PROMPT": "", "OPENAI_BASE_URL": ""})
    assert s.openai_api_key is None and s.system_prompt is None and s.openai_base_url is None
    assert s.upstream_kind == "none"


def test_keys_are_secret():
    s = Settings.from_env({"OPENAI_API_KEY": "sk-very-secret", "AZURE_OPENAI_API_KEY": "az-very-secret"})
    assert "very-secret" not in repr(s) and "very-secret" not in str(s)
    assert s.openai_api_key.get_secret_value() == "sk-very-secret"


@pytest.mark.parametrize(
    "name, value",
    [
        ("FIRST_TOKEN_TIMEOUT_SECONDS", "0"),
        ("FIRST_TOKEN_TIMEOUT_SECONDS", "3601"),
        ("IDLE_TIMEOUT_SECONDS", "-1"),
        ("TOTAL_TIMEOUT_SECONDS", "86401"),
        ("HEARTBEAT_SECONDS", "201"),
        ("USAGE_WAIT_SECONDS", "-0.1"),
        ("USAGE_WAIT_SECONDS", "61"),
        ("UPSTREAM_MAX_RETRIES", "11"),
        ("UPSTREAM_CONNECT_TIMEOUT_SECONDS", "121"),
        ("MAX_BODY_BYTES", "0"),
        ("MAX_BODY_BYTES", str(100 * 1_048_576 + 1)),
        ("MAX_PROMPT_CHARS", "0"),
        ("UPSTREAM_MAX_RETRIES", "two"),
        ("IDLE_TIMEOUT_SECONDS", "nan"),
    ],
)
def test_out_of_range_values_name_the_setting(name, value):
    with pytest.raises(SettingsError) as info:
        Settings.from_env({name: value})
    assert str(info.value).startswith("invalid app settings: ")
    assert name in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["OPENAI_BASE_URL", "AZURE_OPENAI_ENDPOINT", "MAX_BODY_BYTES", "IDLE_TIMEOUT_SECONDS", "UPSTREAM_MAX_RETRIES"],
)
def test_an_error_never_echoes_the_value(name):
    secret = "sk-LEAKED-1234567890"
    with pytest.raises(SettingsError) as info:
        Settings.from_env({name: secret})
    assert secret not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_every_problem_is_listed():
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"IDLE_TIMEOUT_SECONDS": "0", "MAX_BODY_BYTES": "-5"})
    assert "IDLE_TIMEOUT_SECONDS" in str(info.value) and "MAX_BODY_BYTES" in str(info.value)


def test_model_validate_accepts_field_names_and_aliases_and_is_frozen():
    s = Settings.model_validate({"total_timeout": 0.5, "IDLE_TIMEOUT_SECONDS": 0.1})
    assert s.total_timeout == 0.5 and s.idle_timeout == 0.1
    with pytest.raises(pydantic.ValidationError):
        s.idle_timeout = 3
