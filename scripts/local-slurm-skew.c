/* A node's own wall clock for scripts/local-slurm (HPCSHARD_SLURM_SKEW): preloaded
 * (LD_PRELOAD) into a node's job processes, it moves the wall clock by LOCAL_SLURM_SKEW
 * seconds (a decimal, signed) and nothing else. `scripts/local-slurm up` builds it with cc.
 *
 * Why not libfaketime (Debian's 0.9.10): it maps every clock, CLOCK_MONOTONIC and
 * CLOCK_BOOTTIME included, onto the faked wall clock, and Python 3.11's timed waits
 * (threading.Event.wait(1), Lock.acquire(timeout=1): sem_clockwait on CLOCK_MONOTONIC,
 * which it does not intercept) then never return; with FAKETIME_DONT_FAKE_MONOTONIC=1,
 * time.sleep fails with EINVAL (its clock_nanosleep shifts a monotonic deadline by the
 * wall-clock mapping). Both measured here. A host whose clock is off has a wall clock that
 * is off, and monotonic and boot clocks that still agree with /proc's start times: that is
 * what this does.
 *
 * Covered: reading the wall clock (clock_gettime on CLOCK_REALTIME, _COARSE and CLOCK_TAI,
 * gettimeofday, time, timespec_get), and absolute deadlines on it, shifted back so that a
 * wait lasts what the program meant: clock_nanosleep, sem_timedwait and sem_clockwait,
 * pthread_cond_timedwait (on a condition variable of the wall clock: the default) and
 * pthread_cond_clockwait, pthread_mutex_timedlock and pthread_mutex_clocklock. Not
 * covered: timerfd_settime and timer_settime with absolute wall-clock times, the rwlock and
 * message-queue timed calls, and raw system calls. File times come from the kernel, on the
 * host's clock, as an NFS server's come from the server's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long skew_ns;

__attribute__((constructor)) static void init(void) {
    const char *value = getenv("LOCAL_SLURM_SKEW");
    if (value != NULL)
        skew_ns = (long long)(strtod(value, NULL) * 1e9);
}

static void shift(struct timespec *ts, long long ns) {
    long long total = (long long)ts->tv_nsec + ns % 1000000000LL;
    ts->tv_sec += ns / 1000000000LL + total / 1000000000LL;
    ts->tv_nsec = total % 1000000000LL;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000LL;
        ts->tv_sec -= 1;
    }
}

static int is_wall(clockid_t clock) {
    return clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE || clock == CLOCK_TAI;
}

/* A deadline on the node's wall clock, as the host's. */
static struct timespec host_deadline(const struct timespec *deadline) {
    struct timespec ts = *deadline;
    shift(&ts, -skew_ns);
    return ts;
}

#define REAL(type, name, ...) \
    static type (*real)(__VA_ARGS__); \
    if (real == NULL) real = (type (*)(__VA_ARGS__))dlsym(RTLD_NEXT, name)

int clock_gettime(clockid_t clock, struct timespec *ts) {
    REAL(int, "clock_gettime", clockid_t, struct timespec *);
    int rc = real(clock, ts);
    if (rc == 0 && is_wall(clock))
        shift(ts, skew_ns);
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    REAL(int, "gettimeofday", struct timeval *restrict, void *restrict);
    int rc = real(tv, tz);
    if (rc == 0) {  /* glibc declares tv nonnull */
        struct timespec ts = {tv->tv_sec, tv->tv_usec * 1000};
        shift(&ts, skew_ns);
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}

int timespec_get(struct timespec *ts, int base) {
    if (base != TIME_UTC)
        return 0;
    return clock_gettime(CLOCK_REALTIME, ts) == 0 ? base : 0;
}

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *req, struct timespec *rem) {
    REAL(int, "clock_nanosleep", clockid_t, int, const struct timespec *, struct timespec *);
    if ((flags & TIMER_ABSTIME) && is_wall(clock)) {
        struct timespec ts = host_deadline(req);
        return real(clock, flags, &ts, rem);
    }
    return real(clock, flags, req, rem);
}

int sem_timedwait(sem_t *restrict sem, const struct timespec *restrict deadline) {
    REAL(int, "sem_timedwait", sem_t *, const struct timespec *);
    struct timespec ts = host_deadline(deadline);
    return real(sem, &ts);
}

int sem_clockwait(sem_t *restrict sem, clockid_t clock, const struct timespec *restrict deadline) {
    REAL(int, "sem_clockwait", sem_t *, clockid_t, const struct timespec *);
    if (!is_wall(clock))
        return real(sem, clock, deadline);
    struct timespec ts = host_deadline(deadline);
    return real(sem, clock, &ts);
}

int pthread_cond_timedwait(pthread_cond_t *restrict cond, pthread_mutex_t *restrict mutex,
                           const struct timespec *restrict deadline) {
    static int (*real)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
    if (real == NULL)  /* the current condition variables, not those of glibc 2.2.5 */
        real = (int (*)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *))
            dlvsym(RTLD_NEXT, "pthread_cond_timedwait", "GLIBC_2.3.2");
    /* glibc keeps the clock a condition variable was made with in bit 1 of __wrefs
     * (__PTHREAD_COND_CLOCK_MONOTONIC_MASK): Python's own are monotonic, untouched. */
    if (__atomic_load_n(&cond->__data.__wrefs, __ATOMIC_RELAXED) & 2)
        return real(cond, mutex, deadline);
    struct timespec ts = host_deadline(deadline);
    return real(cond, mutex, &ts);
}

int pthread_cond_clockwait(pthread_cond_t *restrict cond, pthread_mutex_t *restrict mutex,
                           clockid_t clock, const struct timespec *restrict deadline) {
    REAL(int, "pthread_cond_clockwait", pthread_cond_t *, pthread_mutex_t *, clockid_t,
         const struct timespec *);
    if (!is_wall(clock))
        return real(cond, mutex, clock, deadline);
    struct timespec ts = host_deadline(deadline);
    return real(cond, mutex, clock, &ts);
}

int pthread_mutex_timedlock(pthread_mutex_t *restrict mutex, const struct timespec *restrict deadline) {
    REAL(int, "pthread_mutex_timedlock", pthread_mutex_t *, const struct timespec *);
    struct timespec ts = host_deadline(deadline);
    return real(mutex, &ts);
}

int pthread_mutex_clocklock(pthread_mutex_t *restrict mutex, clockid_t clock,
                            const struct timespec *restrict deadline) {
    REAL(int, "pthread_mutex_clocklock", pthread_mutex_t *, clockid_t, const struct timespec *);
    if (!is_wall(clock))
        return real(mutex, clock, deadline);
    struct timespec ts = host_deadline(deadline);
    return real(mutex, clock, &ts);
}
