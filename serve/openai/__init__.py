"""The OpenAI-compatible endpoint under /oai/api/v1 (docs/openai.md). Builds on serve.http and serve.tinker."""
