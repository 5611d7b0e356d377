"""C source of the small cffi module that binds libucp's RMA calls (API mode).

ucxx brings the UCP context, the worker and its progress thread; this module adds what
ucxx's Python API lacks: memory registration, rkeys, endpoints we own, put/get/flush.
Handles cross the boundary as ``uintptr_t`` so no UCX struct is declared to cffi.

Completion: every op is issued against a ``tx_wait_t``. ``pending`` counts the ops still
in flight plus one guard held by the issuer; the last decrement (from a UCX callback, on
whichever thread progresses the worker, or from :c:func:`tx_wait_release`) marks it done
and writes the runtime's eventfd so the asyncio loop wakes up. ``tx_inflight`` counts the
waits not done yet, process-wide: the progress driver does not sleep long while there are
any (see ``tx_driver_main``).
"""

from __future__ import annotations

CDEF = """
typedef struct {
    volatile long pending;
    volatile int status;
    int efd;
} tx_wait_t;

typedef struct {
    volatile int failed;
    volatile int status;
    int efd;
} tx_peer_t;

int tx_mem_map(uintptr_t ctx, uintptr_t addr, size_t len, int cuda, uintptr_t *memh);
int tx_mem_unmap(uintptr_t ctx, uintptr_t memh);
int tx_rkey_pack(uintptr_t ctx, uintptr_t memh, void **buf, size_t *size);
void tx_rkey_buffer_release(void *buf);
int tx_rkey_unpack(uintptr_t ep, const void *buf, uintptr_t *rkey);
void tx_rkey_destroy(uintptr_t rkey);

int tx_ep_create(uintptr_t worker, const void *address, int error_handling, tx_peer_t *peer,
                 uintptr_t *ep);
int tx_ep_close(uintptr_t ep, int force, tx_wait_t *w);
int tx_ep_transports(uintptr_t ep, char *out, size_t outlen);
char *tx_ep_info(uintptr_t ep);
void tx_free(void *p);

int tx_put(uintptr_t ep, uintptr_t buf, size_t len, uint64_t raddr, uintptr_t rkey,
           uintptr_t memh, tx_wait_t *w);
int tx_get(uintptr_t ep, uintptr_t buf, size_t len, uint64_t raddr, uintptr_t rkey,
           uintptr_t memh, tx_wait_t *w);
int tx_flush(uintptr_t ep, tx_wait_t *w);
void tx_wait_init(tx_wait_t *w, int efd);
int tx_wait_release(tx_wait_t *w);

unsigned tx_progress(uintptr_t worker, unsigned rounds, tx_wait_t *w);
int tx_signal(uintptr_t worker);

void *tx_driver_start(uintptr_t worker, long spin_ns, long busy_spin_ns, int *err);
void tx_driver_set_cuda(void *driver, uintptr_t cuda_ctx);
int tx_driver_cuda(void *driver);
void tx_driver_stop(void *driver);
unsigned long tx_driver_sleeps(void *driver);
unsigned long tx_driver_timeouts(void *driver);
const char *tx_status_string(int status);
const char *tx_version(void);
int tx_probe_address(const void *address, int error_handling);
char *tx_context_info(uintptr_t ctx);
"""

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <stdint.h>
#include <errno.h>
#include <pthread.h>
#include <dlfcn.h>
#include <sched.h>
#include <time.h>
#include <sys/epoll.h>
#include <ucp/api/ucp.h>

typedef struct {
    volatile long pending;
    volatile int status;
    int efd;
} tx_wait_t;

typedef struct {
    volatile int failed;
    volatile int status;
    int efd;
} tx_peer_t;

static void tx_kick(int efd)
{
    uint64_t one = 1;
    if (efd >= 0) {
        ssize_t r = write(efd, &one, sizeof(one));
        (void)r;
    }
}

static volatile long tx_inflight;  /* waits not done yet, in this process */

static void tx_wait_done_one(tx_wait_t *w, ucs_status_t status)
{
    if (status != UCS_OK) {
        __sync_bool_compare_and_swap(&w->status, 0, (int)status);
    }
    if (__sync_sub_and_fetch(&w->pending, 1) == 0) {
        __sync_sub_and_fetch(&tx_inflight, 1);
        tx_kick(w->efd);
    }
}

static void tx_op_cb(void *request, ucs_status_t status, void *user_data)
{
    tx_wait_done_one((tx_wait_t *)user_data, status);
    ucp_request_free(request);
}

static void tx_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    tx_peer_t *peer = (tx_peer_t *)arg;
    (void)ep;
    peer->status = (int)status;
    __sync_synchronize();
    peer->failed = 1;
    tx_kick(peer->efd);
}

void tx_wait_init(tx_wait_t *w, int efd)
{
    w->pending = 1;  /* the issuer's guard */
    w->status = 0;
    w->efd = efd;
    __sync_add_and_fetch(&tx_inflight, 1);
}

int tx_wait_release(tx_wait_t *w)
{
    if (__sync_sub_and_fetch(&w->pending, 1) == 0) {
        __sync_sub_and_fetch(&tx_inflight, 1);
        return 1;
    }
    return 0;
}

/* Account for one op that returned ``ptr``: 0 done now, 1 in flight, <0 error. */
static int tx_track(tx_wait_t *w, ucs_status_ptr_t ptr)
{
    if (UCS_PTR_IS_PTR(ptr)) {
        return 1;
    }
    __sync_sub_and_fetch(&w->pending, 1);
    if (UCS_PTR_IS_ERR(ptr)) {
        __sync_bool_compare_and_swap(&w->status, 0, (int)UCS_PTR_STATUS(ptr));
        return (int)UCS_PTR_STATUS(ptr);
    }
    return 0;
}

static void tx_param(ucp_request_param_t *p, tx_wait_t *w, uintptr_t memh)
{
    memset(p, 0, sizeof(*p));
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p->cb.send = tx_op_cb;
    p->user_data = w;
    if (memh) {
        p->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p->memh = (ucp_mem_h)memh;
    }
}

int tx_mem_map(uintptr_t ctx, uintptr_t addr, size_t len, int cuda, uintptr_t *memh)
{
    ucp_mem_map_params_t p;
    ucp_mem_h h = NULL;
    ucs_status_t st;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    p.address = (void *)addr;
    p.length = len;
    p.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    st = ucp_mem_map((ucp_context_h)ctx, &p, &h);
    *memh = (uintptr_t)h;
    return (int)st;
}

int tx_mem_unmap(uintptr_t ctx, uintptr_t memh)
{
    return (int)ucp_mem_unmap((ucp_context_h)ctx, (ucp_mem_h)memh);
}

int tx_rkey_pack(uintptr_t ctx, uintptr_t memh, void **buf, size_t *size)
{
    return (int)ucp_rkey_pack((ucp_context_h)ctx, (ucp_mem_h)memh, buf, size);
}

void tx_rkey_buffer_release(void *buf)
{
    ucp_rkey_buffer_release(buf);
}

int tx_rkey_unpack(uintptr_t ep, const void *buf, uintptr_t *rkey)
{
    ucp_rkey_h k = NULL;
    ucs_status_t st = ucp_ep_rkey_unpack((ucp_ep_h)ep, buf, &k);
    *rkey = (uintptr_t)k;
    return (int)st;
}

void tx_rkey_destroy(uintptr_t rkey)
{
    ucp_rkey_destroy((ucp_rkey_h)rkey);
}

int tx_ep_create(uintptr_t worker, const void *address, int error_handling, tx_peer_t *peer,
                 uintptr_t *ep)
{
    ucp_ep_params_t p;
    ucp_ep_h h = NULL;
    ucs_status_t st;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = (const ucp_address_t *)address;
    p.err_mode = error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (error_handling) {
        p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        p.err_handler.cb = tx_err_cb;
        p.err_handler.arg = peer;
    }
    st = ucp_ep_create((ucp_worker_h)worker, &p, &h);
    *ep = (uintptr_t)h;
    return (int)st;
}

int tx_ep_close(uintptr_t ep, int force, tx_wait_t *w)
{
    ucp_request_param_t p;
    tx_param(&p, w, 0);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    __sync_add_and_fetch(&w->pending, 1);
    return tx_track(w, ucp_ep_close_nbx((ucp_ep_h)ep, &p));
}

int tx_ep_transports(uintptr_t ep, char *out, size_t outlen)
{
    ucp_transport_entry_t entries[16];
    ucp_ep_attr_t attr;
    ucs_status_t st;
    size_t used = 0;
    unsigned i;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    st = ucp_ep_query((ucp_ep_h)ep, &attr);
    if (st != UCS_OK) {
        return (int)st;
    }
    out[0] = '\0';
    for (i = 0; i < attr.transports.num_entries && used < outlen; ++i) {
        int n = snprintf(out + used, outlen - used, "%s%s/%s", i ? "," : "",
                         entries[i].transport_name, entries[i].device_name);
        if (n < 0) {
            break;
        }
        used += (size_t)n;
    }
    return 0;
}

char *tx_ep_info(uintptr_t ep)
{
    char *buf = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&buf, &size);
    if (f == NULL) {
        return NULL;
    }
    ucp_ep_print_info((ucp_ep_h)ep, f);
    fclose(f);
    return buf;
}

void tx_free(void *p)
{
    free(p);
}

int tx_put(uintptr_t ep, uintptr_t buf, size_t len, uint64_t raddr, uintptr_t rkey,
           uintptr_t memh, tx_wait_t *w)
{
    ucp_request_param_t p;
    tx_param(&p, w, memh);
    __sync_add_and_fetch(&w->pending, 1);
    return tx_track(w, ucp_put_nbx((ucp_ep_h)ep, (const void *)buf, len, raddr,
                                   (ucp_rkey_h)rkey, &p));
}

int tx_get(uintptr_t ep, uintptr_t buf, size_t len, uint64_t raddr, uintptr_t rkey,
           uintptr_t memh, tx_wait_t *w)
{
    ucp_request_param_t p;
    tx_param(&p, w, memh);
    __sync_add_and_fetch(&w->pending, 1);
    return tx_track(w, ucp_get_nbx((ucp_ep_h)ep, (void *)buf, len, raddr,
                                   (ucp_rkey_h)rkey, &p));
}

int tx_flush(uintptr_t ep, tx_wait_t *w)
{
    ucp_request_param_t p;
    tx_param(&p, w, 0);
    __sync_add_and_fetch(&w->pending, 1);
    return tx_track(w, ucp_ep_flush_nbx((ucp_ep_h)ep, &p));
}

/* Progress at most ``rounds`` passes, stopping early once ``w`` is done. */
unsigned tx_progress(uintptr_t worker, unsigned rounds, tx_wait_t *w)
{
    unsigned i;
    for (i = 0; i < rounds; ++i) {
        if (w != NULL && w->pending == 0) {
            break;
        }
        ucp_worker_progress((ucp_worker_h)worker);
    }
    return i;
}

int tx_signal(uintptr_t worker)
{
    return (int)ucp_worker_signal((ucp_worker_h)worker);
}

/* The progress driver: one thread that progresses the worker while there is work, keeps
 * polling for ``spin_ns`` after the last sign of work (a bulk transfer over tcp produces
 * work every few microseconds, and waking up for each piece costs more than polling), and
 * for ``busy_spin_ns`` while any op is in flight: a completion may come with no fd to wake
 * a sleeper (a shared-memory transport moves data inside progress calls, a CUDA copy ends
 * on the device, and on some kernels the worker's fd stays quiet after ucp_worker_arm), so
 * sleeping through it would cost the op a whole epoll timeout. Past both it arms the worker
 * and sleeps in epoll until the worker's fd (or ucp_worker_signal) wakes it: at most 1 ms
 * while an op is in flight (a stalled op polled at low cost: ``timeouts`` counts these
 * waits that ended with nothing to wake them), 100 ms when idle. A wake-up by the fd is a
 * sign of work; a timed-out wait is not, so a stalled op does not spin again.
 */
typedef struct {
    pthread_t thread;
    ucp_worker_h worker;
    long spin_ns;
    long busy_spin_ns;
    int epfd;
    volatile int stop;
    volatile unsigned long sleeps;
    volatile unsigned long timeouts;
    volatile uintptr_t cuda_want;  /* a CUcontext to make current on the driver thread */
    uintptr_t cuda_have;
    volatile int cuda_status;      /* -1 not yet, 0 current, -2 no libcuda, else CUresult */
} tx_driver_t;

/* UCX's CUDA transports work in the context current on the thread that progresses them:
 * the driver thread installs the one Python hands it (the device's primary context),
 * through libcuda loaded at run time, so the binding links no CUDA library. */
static void tx_driver_apply_cuda(tx_driver_t *d)
{
    typedef int (*set_current_t)(void *);
    static set_current_t set_current;
    uintptr_t want = d->cuda_want;
    if (set_current == NULL) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL) {
            h = dlopen("libcuda.so.1", RTLD_NOW);
        }
        set_current = h ? (set_current_t)dlsym(h, "cuCtxSetCurrent") : NULL;
    }
    d->cuda_status = set_current ? set_current((void *)want) : -2;
    d->cuda_have = want;
}

static long tx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *tx_driver_main(void *arg)
{
    tx_driver_t *d = (tx_driver_t *)arg;
    struct epoll_event ev;
    long busy = tx_now_ns();
    while (!d->stop) {
        if (d->cuda_want != d->cuda_have) {
            tx_driver_apply_cuda(d);
        }
        if (ucp_worker_progress(d->worker)) {
            busy = tx_now_ns();
            continue;
        }
        long quiet = tx_now_ns() - busy;
        if (quiet < d->spin_ns || (tx_inflight > 0 && quiet < d->busy_spin_ns)) {
            sched_yield();  /* polling, but never ahead of a thread that shares our core */
            continue;
        }
        ucs_status_t st = ucp_worker_arm(d->worker);
        if (st == UCS_ERR_BUSY) {
            busy = tx_now_ns();
            continue;
        }
        if (st == UCS_OK) {
            int waiting = tx_inflight > 0;
            int n;
            d->sleeps++;
            while ((n = epoll_wait(d->epfd, &ev, 1, waiting ? 1 : 100)) < 0 &&
                   errno == EINTR && !d->stop) {
            }
            if (n > 0) {
                busy = tx_now_ns();
            } else if (waiting) {
                d->timeouts++;
            }
        } else {
            busy = tx_now_ns();
        }
    }
    return NULL;
}

void *tx_driver_start(uintptr_t worker, long spin_ns, long busy_spin_ns, int *err)
{
    struct epoll_event ev;
    int wfd = -1;
    tx_driver_t *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        *err = (int)UCS_ERR_NO_MEMORY;
        return NULL;
    }
    d->worker = (ucp_worker_h)worker;
    d->spin_ns = spin_ns;
    d->busy_spin_ns = busy_spin_ns;
    d->cuda_status = -1;
    *err = (int)ucp_worker_get_efd(d->worker, &wfd);
    if (*err != UCS_OK) {
        free(d);
        return NULL;
    }
    d->epfd = epoll_create1(EPOLL_CLOEXEC);
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = wfd;
    if (d->epfd < 0 || epoll_ctl(d->epfd, EPOLL_CTL_ADD, wfd, &ev) != 0 ||
        pthread_create(&d->thread, NULL, tx_driver_main, d) != 0) {
        *err = (int)UCS_ERR_IO_ERROR;
        if (d->epfd >= 0) {
            close(d->epfd);
        }
        free(d);
        return NULL;
    }
    return d;
}

void tx_driver_stop(void *driver)
{
    tx_driver_t *d = (tx_driver_t *)driver;
    d->stop = 1;
    ucp_worker_signal(d->worker);
    pthread_join(d->thread, NULL);
    close(d->epfd);
    free(d);
}

void tx_driver_set_cuda(void *driver, uintptr_t cuda_ctx)
{
    tx_driver_t *d = (tx_driver_t *)driver;
    d->cuda_status = -1;
    d->cuda_want = cuda_ctx;
    ucp_worker_signal(d->worker);  /* it may sleep in epoll_wait */
}

int tx_driver_cuda(void *driver)
{
    return ((tx_driver_t *)driver)->cuda_status;
}

unsigned long tx_driver_sleeps(void *driver)
{
    return ((tx_driver_t *)driver)->sleeps;
}

unsigned long tx_driver_timeouts(void *driver)
{
    return ((tx_driver_t *)driver)->timeouts;
}

const char *tx_status_string(int status)
{
    return ucs_status_string((ucs_status_t)status);
}

const char *tx_version(void)
{
    return ucp_get_version_string();
}

/* Open an endpoint to ``address`` in a context and worker of our own: libucp aborts the
 * process on some malformed addresses, so this runs in a throwaway child process (see
 * ``_ucx_probe.py``) before the node hands a peer's address to its own worker. */
int tx_probe_address(const void *address, int error_handling)
{
    ucp_config_t *config = NULL;
    ucp_params_t params;
    ucp_worker_params_t wparams;
    ucp_context_h ctx = NULL;
    ucp_worker_h worker = NULL;
    ucp_ep_params_t ep_params;
    ucp_ep_h ep = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        return (int)st;
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    st = ucp_init(&params, config, &ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        return (int)st;
    }
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(ctx, &wparams, &worker);
    if (st != UCS_OK) {
        return (int)st;
    }
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.address = (const ucp_address_t *)address;
    ep_params.err_mode = error_handling ? UCP_ERR_HANDLING_MODE_PEER
                                        : UCP_ERR_HANDLING_MODE_NONE;
    return (int)ucp_ep_create(worker, &ep_params, &ep);  /* the process exits next */
}

char *tx_context_info(uintptr_t ctx)
{
    char *buf = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&buf, &size);
    if (f == NULL) {
        return NULL;
    }
    ucp_context_print_info((ucp_context_h)ctx, f);
    fclose(f);
    return buf;
}
"""
