/* The kernels' thread pool: workers spin briefly on a generation counter, then sleep. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "kernels.h"

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A job is a number of units (a run of columns, an attention row and head) that the threads claim one at
 * a time from a shared counter, so a thread the OS preempts (another process wants the core) holds back
 * only the unit it is in, not a fixed share. The counter carries the job's generation: a worker that
 * claims a unit is sure of the job it read, and a late worker finds the units gone and goes back to
 * sleep without being waited for. */
#define MAX_THREADS 64
#define CLOSED 0xFFFFFFFFu
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
/* what every thread writes, each on a cache line of its own: sharing one with what they only read would
 * move it between the cores at every claim */
static _Alignas(64) _Atomic uint64_t claim; /* generation << 32 | the next unclaimed unit (CLOSED while a job is set) */
static _Alignas(64) atomic_int done_units;
static _Alignas(64) atomic_int generation, n_threads = 1, n_started = 1;
static _Atomic(ss_task_fn) current_fn;
static _Atomic(const void *) current_job;
static atomic_int current_units;

/* Claims and runs units until none is left; the units it ran are counted once, at the end, and returned. */
static int drain(int part) {
    int ran = 0;
    for (;;) {
        uint64_t c = atomic_load_explicit(&claim, memory_order_acquire);
        const ss_task_fn fn = atomic_load_explicit(&current_fn, memory_order_relaxed);
        const void *job = atomic_load_explicit(&current_job, memory_order_relaxed);
        const uint32_t unit = (uint32_t)c;
        if (unit == CLOSED || unit >= (uint32_t)atomic_load_explicit(&current_units, memory_order_relaxed)) break;
        if (!atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel, memory_order_relaxed))
            continue; /* claimed by another thread, or a new job: read again */
        fn(job, (int)unit, part);
        ran++;
    }
    if (ran) atomic_fetch_add_explicit(&done_units, ran, memory_order_release);
    return ran;
}

static void *worker(void *arg) {
    const int part = (int)(intptr_t)arg;
    int seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < 20000) {
                spin_pause();
                continue;
            }
            pthread_mutex_lock(&mu);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &mu);
            pthread_mutex_unlock(&mu);
        }
        seen = atomic_load(&generation);
        if (part < atomic_load(&n_threads)) drain(part);
    }
    return 0;
}

int ss_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    for (int i = atomic_load(&n_started); i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, 0, worker, (void *)(intptr_t)i) != 0) return atomic_load(&n_threads);
        pthread_detach(t);
        atomic_store(&n_started, i + 1);
    }
    atomic_store(&n_threads, n);
    return n;
}

/* Under load. With one busy process on a 2-core machine two threads run slower than one: the OS
 * preempts one of them, the caller then runs most units itself and still waits for the unit the other
 * holds, and the threads take turns on the cores with the busy process. So the caller watches each job
 * of enough units: it lagged when the caller ran more than 1.5 times its share of the units, or waited
 * for the others longer than it worked. When more than LAG_SHARE of the last ~100 jobs lagged, the caller
 * runs the next SOLO_JOBS jobs alone (the other threads go to sleep and leave their cores to whoever
 * wants them), then tries them again: a machine that is still loaded shows it within a few dozen jobs,
 * and each time it does so soon after a solo run, the next one is twice as long (up to SOLO_MOST, ~200
 * steps), since every try costs the jobs that wait on a preempted thread. Not the last ~10 jobs: the
 * engine's own work between two steps (its other processes on the same cores) preempts a thread for a
 * few jobs at every token, and a window that short took that for load and ran a quiet 2-core Xeon's
 * decode steps alone half the time (`ar` 220 tok/s instead of 290). The results do not depend on the
 * number of threads, only the time does. */
#define LAG_SHARE 0.3
#define SOLO_JOBS 1024 /* ~7 decode steps of a small model: 5 jobs a layer */
#define SOLO_MOST (32 * SOLO_JOBS)
#define TRY_JOBS 64
static double lag_rate; /* the share of the recent jobs that lagged, a moving average over ~100 jobs */
static int solo_left, solo_jobs = SOLO_JOBS;
static long tried_jobs = TRY_JOBS; /* jobs judged since the last solo run */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Runs fn over units 0 .. units - 1 on the pool's threads (the caller is part 0), or alone when small or
 * when the machine is loaded (above). Not reentrant: one caller at a time (a rank's one compute thread). */
void ss_run(ss_task_fn fn, const void *job, int units, int small) {
    const int alone = atomic_load(&n_threads) == 1 || small || units <= 1;
    if (alone || solo_left > 0) {
        if (!alone) solo_left--;
        for (int u = 0; u < units; u++) fn(job, u, 0);
        return;
    }
    const double t0 = seconds();
    const uint64_t g = (atomic_load(&claim) >> 32) + 1;
    atomic_store(&claim, g << 32 | CLOSED);
    atomic_store_explicit(&current_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&current_job, job, memory_order_relaxed);
    atomic_store_explicit(&current_units, units, memory_order_relaxed);
    atomic_store_explicit(&done_units, 0, memory_order_relaxed);
    atomic_store_explicit(&claim, g << 32, memory_order_release);
    pthread_mutex_lock(&mu);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    const int mine = drain(0);
    const double t1 = seconds();
    while (atomic_load_explicit(&done_units, memory_order_acquire) < units) {
        spin_pause();
    }
    const double waited = seconds() - t1;
    if (units < 2 * atomic_load(&n_threads)) return; /* too few to tell a lag from a late start */
    const int lagged = 2 * mine * atomic_load(&n_threads) > 3 * units || waited > t1 - t0 + 20e-6;
    const double weight = tried_jobs < TRY_JOBS ? 0.1 : 0.01; /* a try is judged on its first few jobs */
    lag_rate = (1.0 - weight) * lag_rate + (lagged ? weight : 0.0);
    tried_jobs++;
    if (lag_rate > LAG_SHARE) { /* lagging again soon after a solo run: the load stays, stay alone longer */
        solo_jobs = tried_jobs < SOLO_JOBS ? (2 * solo_jobs < SOLO_MOST ? 2 * solo_jobs : SOLO_MOST) : SOLO_JOBS;
        solo_left = solo_jobs, lag_rate = 0.0, tried_jobs = 0;
    }
}

int ss_threads(void) { return atomic_load(&n_threads); }
