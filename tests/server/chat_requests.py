"""A chat completion's first choice, or a streamed one's choices, as the tests of chat parsing read them."""

from __future__ import annotations

import json

import httpx


def chat_choice(client: httpx.Client, body: dict) -> dict:
    """The first choice of a non-streamed chat completion (asserting a 200)."""
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed_choices(client: httpx.Client, body: dict) -> list[dict]:
    """The choices of every chunk of a streamed chat completion after the role chunk."""
    choices = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[len("data: "):])["choices"]
    return choices[1:]
