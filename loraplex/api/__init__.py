"""HTTP gateway: stateless FastAPI app. Routes validate, authenticate, write through repositories and enqueue to Redis."""
