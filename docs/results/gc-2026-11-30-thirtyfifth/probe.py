import gc, time
import ray, ray.serve, mlflow, fastapi  # noqa: F401 - what a replica process imports
from serving.service import Service, ServiceSettings, freeze_startup_heap

svc = Service(ServiceSettings(gc_freeze=False))   # a replica of the default target (no registry: the target alone)
def full_ms():
    gc.collect(); t = time.perf_counter(); gc.collect(); return (time.perf_counter() - t) * 1e3
print(f"tracked objects {len(gc.get_objects())}; a full collection {full_ms():.0f} ms")
print(f"frozen {freeze_startup_heap()}; tracked objects {len(gc.get_objects())}; a full collection {full_ms():.1f} ms")
svc.close()
