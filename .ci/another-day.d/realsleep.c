/* Sleeps as the kernel does them, ahead of libfaketime in LD_PRELOAD: with FAKETIME_DONT_FAKE_MONOTONIC=1 only the
   wall clock is faked, and libfaketime's own clock_nanosleep then refuses monotonic deadlines (EINVAL). */
#define _GNU_SOURCE
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
int clock_nanosleep(clockid_t clock, int flags, const struct timespec *request, struct timespec *remain) {
    long r = syscall(SYS_clock_nanosleep, clock, flags, request, remain);
    return r == 0 ? 0 : errno;
}
int nanosleep(const struct timespec *request, struct timespec *remain) {
    return (int)syscall(SYS_nanosleep, request, remain);
}
