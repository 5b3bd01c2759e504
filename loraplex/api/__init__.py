"""HTTP gateway: stateless FastAPI app. Routes authenticate and translate HTTP to calls of the service layer
(service/), which holds the gateway's rules, writes through repositories and enqueues to Redis."""
