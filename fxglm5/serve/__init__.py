"""Serving: the one builder of a running engine (:mod:`fxglm5.serve.build`) and ``fxglm5 serve``, an
OpenAI-compatible HTTP server over it (:mod:`fxglm5.serve.app`, :mod:`fxglm5.serve.protocol`,
:mod:`fxglm5.serve.loop`)."""
