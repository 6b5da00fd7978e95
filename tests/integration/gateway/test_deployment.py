"""The gateway deployment's API keys: the configured ones plus those the environment adds."""

from pdserve.config import GatewayConfig
from pdserve.gateway.deployment import API_KEYS_ENV, with_env_api_keys


def test_api_keys_from_the_environment_add_to_the_configured_ones(monkeypatch):
    gateway = GatewayConfig(api_keys=["sk-a"])
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert with_env_api_keys(gateway).api_keys == ["sk-a"]
    monkeypatch.setenv(API_KEYS_ENV, " sk-b, ,sk-a,sk-c ")
    assert with_env_api_keys(gateway).api_keys == ["sk-a", "sk-b", "sk-c"]
    monkeypatch.delenv(API_KEYS_ENV)
    assert with_env_api_keys(GatewayConfig()).api_keys == []  # no keys configured or set: no auth
