"""``pp-serve``: an OpenAI-compatible HTTP endpoint in front of a pipeline of stage workers.

``cli`` starts the stages (as ``pp-pipeline`` does) and uvicorn; ``app`` is the Starlette app; ``api`` validates
completions requests with ``fields``; ``feed`` carries one generation's text from the pipeline thread to the event
loop; ``stages`` (``/stages``, ``/tokenize``, ``/detokenize``), ``metrics``, ``page`` (the chat page, ``/props``)
and ``access`` (API keys, CORS) are the rest of the HTTP surface; ``drain`` and ``warming`` the server's two ends."""
