"""The OpenAI-compatible API surface shared by the router and the workers: request and response models, several
choices per request, response formatting, function calling and structured outputs, and the /v1/models and
/tokenize routes."""
