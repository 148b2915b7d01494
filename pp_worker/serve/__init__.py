"""``pp-serve``: an OpenAI-compatible HTTP endpoint in front of a pipeline of stage workers.

``cli`` starts the stages (as ``pp-pipeline`` does) and uvicorn; ``app`` is the Starlette app; ``api`` validates
requests; ``feed`` carries one generation's text from the pipeline thread to the event loop."""
