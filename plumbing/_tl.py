import os, time
def mark(what):
    with open("/tmp/tl.txt", "a") as f:
        f.write(f"{time.time():.3f} {os.getpid()} cpu={time.process_time():.2f} {what}\n")
