"""OpenAI's Responses API over the front door's engines (:mod:`memkv.api.routes.responses`)."""
