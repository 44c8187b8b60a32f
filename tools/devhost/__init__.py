import os

# Set before anything imports grpc: the host starts its workers with fork+exec (uvloop forks rather
# than spawns), and gRPC's fork handlers, meant for children that go on using gRPC, only warn here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
