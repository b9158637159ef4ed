import logging

from agentrl.secrets import MASK, RedactingFilter, redact


def test_redact_masks_known_and_pattern_named_vars():
    env = {"DAYTONA_API_KEY": "abcdef123456", "MY_SERVICE_TOKEN": "tok_987654321", "PATH": "/usr/bin"}
    text = "key=abcdef123456 tok=tok_987654321 path=/usr/bin"
    assert redact(text, env) == f"key={MASK} tok={MASK} path=/usr/bin"


def test_short_values_are_not_masked():
    assert redact("a b c", {"DAYTONA_API_KEY": "a"}) == "a b c"


def test_logging_filter(monkeypatch, caplog):
    monkeypatch.setenv("DAYTONA_API_KEY", "sekrit-value-42")
    log = logging.getLogger("agentrl.test.secrets")
    log.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger="agentrl.test.secrets"):
        log.info("using key %s", "sekrit-value-42")
    assert "sekrit-value-42" not in caplog.text and MASK in caplog.text
