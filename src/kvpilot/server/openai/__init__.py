"""The OpenAI API's shapes and rules: request models and their fields, structured outputs, chat messages,
tool calls and parsers, responses, errors, the OpenAPI contract, /tokenize."""
