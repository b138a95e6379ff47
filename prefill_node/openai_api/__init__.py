"""OpenAI's HTTP API as the decode server and the gateway both speak it: errors and prompts."""
