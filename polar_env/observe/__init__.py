"""What an operator watches: Prometheus metrics (``metrics``) and experiment-tracker logging
(``tracker``). Nothing here is on a request's critical path beyond a counter increment."""
