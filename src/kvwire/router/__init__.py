"""OpenAI-compatible router: policy (pure), engine registry, HTTP legs and the FastAPI app."""
