"""What stands between a client's bytes and the app: the listener, the API key, body size and time, and
header timeouts."""
